# One image for every torchyard process (api, ingest, scheduler, worker, migrate): the command
# picks the role. CPU torch by default; the GPU worker image sets TORCH_INDEX to a CUDA index.
FROM node:20-bookworm-slim AS frontend
WORKDIR /src/frontend
COPY frontend/ ./
RUN if [ -f package.json ]; then npm ci && npm run build; else mkdir -p dist; fi

FROM python:3.11-slim-bookworm
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 TORCHYARD_STATE_DIR=/var/lib/torchyard TORCHYARD_FRONTEND_DIST=/app/frontend/dist
WORKDIR /app
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" torch==2.13.0
COPY pyproject.toml README.md ./
COPY torchyard/ torchyard/
COPY backend/ backend/
COPY workers/ workers/
COPY cli/ cli/
COPY migrations/ migrations/
RUN pip install --no-cache-dir .
COPY --from=frontend /src/frontend/dist frontend/dist
# torchyard: the platform's processes (api, ingest, migrate). torchyard-run: TORCHYARD_RUN_USER, the
# user a root worker runs every rank as (docker-compose runs the worker as root; README "Walls").
# The state dir's group is the platform's: ranks' checkpoints are shared with it, so the api reads them.
RUN useradd --create-home torchyard \
 && useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin torchyard-run \
 && mkdir -p /var/lib/torchyard && chown torchyard:torchyard /var/lib/torchyard
USER torchyard
EXPOSE 8000
CMD ["torchyard", "api", "--host", "0.0.0.0"]
