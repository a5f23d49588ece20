import { defineConfig } from "vitest/config";

// Preact's automatic JSX runtime (tsconfig: jsx react-jsx, jsxImportSource preact); no plugin needed.
export default defineConfig({
  base: "./",
  oxc: { jsx: { runtime: "automatic", importSource: "preact" } },
  build: { outDir: "dist", emptyOutDir: true, sourcemap: false, chunkSizeWarningLimit: 300 },
  server: { proxy: { "/api": "http://127.0.0.1:8000" } },
  test: { include: ["src/**/*.test.ts"], environment: "node" },
});
