// The headless Chromium page the real-frontend drivers (tests/web/*.mjs) run in: playwright-core, a
// throwaway profile under `out`, and the page's console messages of `consoleTypes` and its uncaught
// errors collected into `report.console` / `report.pageErrors`.
import path from "node:path";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const { chromium } = require("playwright-core");

export async function openPage({ out, executablePath, report, viewport = { width: 1400, height: 900 },
  deviceScaleFactor = undefined, consoleTypes = ["error"], withStacks = false }) {
  const context = await chromium.launchPersistentContext(path.join(out, "chromium-profile"), {
    executablePath,
    headless: true,
    viewport,
    ...(deviceScaleFactor === undefined ? {} : { deviceScaleFactor }),
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
  const page = context.pages()[0] ?? (await context.newPage());
  page.on("console", (message) => {
    if (!consoleTypes.includes(message.type())) return;
    const entry = { text: message.text(), url: message.location()?.url ?? "" };
    report.console.push(consoleTypes.length > 1 ? { type: message.type(), ...entry } : entry);
  });
  page.on("pageerror", (error) => report.pageErrors.push(
    withStacks ? { text: String(error), stack: error.stack ?? "" } : String(error)));
  return { context, page };
}
