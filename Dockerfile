# One image for every torchyard process (api, ingest, scheduler, worker, migrate): the command
# picks the role. CPU torch by default; the GPU worker image sets TORCH_INDEX to a CUDA index.
FROM node:20-bookworm-slim AS frontend
WORKDIR /src/frontend
COPY frontend/ ./
RUN if [ -f package.json ]; then npm ci && npm run build; else mkdir -p dist; fi

FROM python:3.11-slim-bookworm
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 TORCHYARD_STATE_DIR=/var/lib/torchyard
WORKDIR /app
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" torch==2.13.0
COPY pyproject.toml README.md ./
COPY torchyard/ torchyard/
COPY backend/ backend/
COPY workers/ workers/
COPY migrations/ migrations/
RUN pip install --no-cache-dir .
COPY --from=frontend /src/frontend/dist frontend/dist
RUN useradd --create-home torchyard && mkdir -p /var/lib/torchyard && chown torchyard /var/lib/torchyard
USER torchyard
EXPOSE 8000
CMD ["torchyard", "api", "--host", "0.0.0.0"]
