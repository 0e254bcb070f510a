// The template browser (Workflow → Browse Templates) as a user meets a pack's templates, for
// load_workflows.mjs --templates PACK: the pack's cards (title, description, picture), then each template
// opened from its card, as the frontend opens it (fitView over the nodes, not the file's extra.ds).
import path from "node:path";

async function openPackPage(page, pack) {
  await page.evaluate(() => window.comfyAPI.app.app.extensionManager.command.execute("Comfy.BrowseTemplates"));
  const dialog = page.locator("[role=dialog]").filter({ has: page.locator("nav") }).first();
  // Custom-node packs are listed under Extensions by their folder name (both frontends). A click event, not
  // a pointer click: the dialog's opening animation kept playwright's "stable element" check waiting.
  await dialog.locator("nav").getByText(pack, { exact: true }).first().dispatchEvent("click");
  await dialog.locator("[data-testid^=template-workflow-]").first().waitFor({ timeout: 30000 });
  return dialog;
}

async function cardsOf(page, names) {
  // Frontend 1.41 renders a card's picture only while the card is in view (three cards a row, two rows shown):
  // bring each into view and read it there. A picture that failed to load is replaced by the frontend's
  // placeholder: wait until each settled.
  const cards = {};
  for (const name of names) {
    await page.locator(`[data-testid="template-workflow-${name}"]`).first().scrollIntoViewIfNeeded();
    await page.waitForFunction((name) => {
      const img = document.querySelector(`[data-testid="template-workflow-${CSS.escape(name)}"] img`);
      return img && img.complete;
    }, name, { timeout: 30000, polling: 250 });
    cards[name] = await page.evaluate((name) => {
      const card = document.querySelector(`[data-testid="template-workflow-${CSS.escape(name)}"]`);
      const img = card?.querySelector("img");
      // 1.49 shows the picture through a blob: URL of what it fetched; 1.41 by its address
      const picture = { src: img?.src ?? null, width: img?.naturalWidth ?? 0, height: img?.naturalHeight ?? 0 };
      return { found: Boolean(card), title: card?.querySelector("h3")?.textContent?.trim() ?? null,
        // frontend 1.41 prints a description line under the title; 1.49 prints none (tags only)
        description: card?.querySelector("p")?.textContent?.trim() ?? null, picture };
    }, name);
  }
  return cards;
}

const signature = (nodes) => nodes.map((node) => `${node.id}:${node.type}`).sort().join(",");

async function openedGraph(page, workflow) {
  await page.waitForFunction(({ wanted, name }) => {   // this template's nodes, in a tab of its own
    const app = window.comfyAPI.app.app;
    const shown = app.graph.nodes.map((node) => `${node.id}:${node.type}`).sort().join(",");
    const tab = app.extensionManager.workflow?.activeWorkflow?.filename;
    return shown === wanted && (tab === undefined || tab.startsWith(name));
  }, { wanted: signature(workflow.nodes), name: workflow.name }, { timeout: 30000, polling: 250 });
  await page.waitForTimeout(500);   // fitView runs once the canvas has a size; let a frame pass (screenshot only)
  return page.evaluate((workflow) => {
    const app = window.comfyAPI.app.app;
    const planned = Object.fromEntries(workflow.nodes.map((node) => [String(node.id), node]));
    const nodes = app.graph.nodes.map((node) => ({
      id: String(node.id), type: node.type, title: node.title, collapsed: Boolean(node.flags?.collapsed),
      rect: [...node.boundingRect], plannedHeight: planned[String(node.id)]?.size?.[1] ?? null,
      height: node.size[1] }));
    const groups = (app.graph.groups ?? app.graph._groups ?? []).map((group) => ({
      title: group.title, color: group.color, rect: [...(group._bounding ?? group.bounding)] }));
    return { scale: app.canvas.ds.scale, canvas: [app.canvas.canvas.clientWidth, app.canvas.canvas.clientHeight],
      tab: app.extensionManager.workflow?.activeWorkflow?.filename ?? null, nodes, groups };
  }, workflow);
}

export async function browseTemplates(page, { pack, out }) {
  await page.evaluate(() => window.comfyAPI.app.app.extensionManager.setting.set(
    "Comfy.Workflow.ShowMissingModelsWarning", false));   // no model files here: keep the dialog off the canvas
  const listed = await page.evaluate(async () => (await (await fetch("api/workflow_templates")).json()));
  const names = [...(listed[pack] ?? [])].sort();
  const report = { names, cards: {}, pictures: {}, opened: {} };
  const prefix = `/api/workflow_templates/${pack}/`;
  const watch = (response) => {   // the pictures the browser fetched for the cards
    const address = decodeURIComponent(new URL(response.url()).pathname);
    if (!address.startsWith(prefix) || address.endsWith(".json")) return;
    const headers = response.headers();
    report.pictures[address.slice(prefix.length)] = { status: response.status(),
      type: headers["content-type"] ?? null, bytes: Number(headers["content-length"] ?? 0) };
  };
  page.on("response", watch);
  await openPackPage(page, pack);
  report.cards = await cardsOf(page, names);
  page.off("response", watch);
  await page.screenshot({ path: path.join(out, "template-browser.png") });
  for (const name of names) {
    const workflow = await page.evaluate(async ({ pack, name }) =>
      (await fetch(`api/workflow_templates/${pack}/${encodeURIComponent(name)}.json`)).json(), { pack, name });
    const dialog = await openPackPage(page, pack);
    await dialog.locator(`[data-testid="template-workflow-${name}"]`).click();
    report.opened[name] = await openedGraph(page, { ...workflow, name });
    await page.screenshot({ path: path.join(out, `template-${name}.png`) });
  }
  return report;
}
