// What each page does after loading: the live training view and the resource monitor poll the JSON API and
// append to their charts; the cost page refreshes its running totals; the checkpoints page reloads while
// large checkpoints are still being verified. Which one runs is chosen by <body data-page>.
"use strict";

(function () {
  const { LineChart, fetchJSON } = window.Gaudi3;
  const SLOW_FACTOR = 5; // a finished run is polled this many times less often

  function setConnection(error) {
    const element = document.getElementById("connection");
    if (!element) return;
    element.textContent = error ? "· " + error + " — retrying" : "· live";
    element.classList.toggle("error", Boolean(error));
  }

  function setFields(selector, attribute, values, root = document) {
    for (const element of root.querySelectorAll(selector)) {
      const key = element.getAttribute(attribute);
      if (values[key] !== undefined) element.textContent = values[key];
    }
  }

  function setStatus(status) {
    for (const badge of document.querySelectorAll('[data-field="status"]')) {
      badge.textContent = status;
      badge.className = "badge " + status;
    }
  }

  function setWarnings(warnings) {
    const list = document.getElementById("warnings");
    if (!list) return;
    list.replaceChildren(
      ...warnings.map((text) => {
        const item = document.createElement("li");
        item.textContent = text;
        return item;
      }),
    );
  }

  // The run's progress over wall time (minutes from the trainer's start): measured from the records' wall_s, and the
  // forecast's predicted line (plan.json, served as eta.forecast.points in seconds), with the finish each points to.
  function setEta(progress, eta) {
    const points = eta.forecast ? eta.forecast.points.map(([s, step]) => [s / 60, step]) : [];
    progress.replace("predicted", points);
    const line = document.getElementById("eta");
    if (!line) return;
    line.title = eta.forecast && eta.forecast.step_time_source ? "step time: " + eta.forecast.step_time_source : "";
    setFields("#eta [data-eta]", "data-eta", eta.text);
    line.querySelector('[data-eta="live"]').hidden = !eta.text.live;
  }

  // JSON the page carries in a <script type="application/json" id=…> (a run's name: see _run_nav.html).
  function pageData(id) {
    return JSON.parse(document.getElementById(id).textContent);
  }

  function liveRun(body) {
    const name = pageData("run-name");
    const interval = Number(body.dataset.pollMs) || 1000;
    const figure = (id) => document.getElementById(id);
    const costFigure = figure("chart-cost");
    const loss = new LineChart(figure("chart-loss"), [
      { key: "train_loss", label: "train" },
      { key: "val_loss", label: "validation", markers: true },
    ], { xLabel: "step" });
    const progress = new LineChart(figure("chart-progress"), [
      { key: "measured", label: "measured" },
      { key: "predicted", label: "predicted", dashed: true },
    ], { xLabel: "minutes", yMin: 0 });
    const charts = [
      [loss, ["train_loss", "val_loss"]],
      [new LineChart(figure("chart-throughput"), [{ key: "tokens_per_s", label: "tokens/s" }], { xLabel: "step", yMin: 0 }),
        ["tokens_per_s"]],
      [new LineChart(figure("chart-mfu"), [{ key: "mfu", label: "MFU" }], { yFormat: "percent", xLabel: "step", yMin: 0 }),
        ["mfu"]],
      [new LineChart(costFigure, [{ key: "cost_usd", label: "accrued" }], { xLabel: "step", yMin: 0 }), ["cost_usd"]],
    ];
    let next = 0;
    let file = null; // which copy of metrics.jsonl `next` counts lines of (a run started over gets another)
    let shownEta = null;

    async function poll() {
      let delay = interval;
      try {
        const copy = file === null ? "" : "&file=" + encodeURIComponent(file);
        const data = await fetchJSON(`/api/runs/${encodeURIComponent(name)}/metrics?since=${next}${copy}`);
        if (data.reset) [progress, ...charts.map(([chart]) => chart)].forEach((chart) => chart.clear());
        for (const record of data.records) {
          for (const [chart, keys] of charts) for (const key of keys) chart.add(key, record.step, record[key]);
          if (typeof record.wall_s === "number") progress.add("measured", record.wall_s / 60, record.step);
        }
        const marks = data.health_marks || [];
        for (const mark of marks) loss.addMark(mark); // health events, on the loss curve
        next = data.next;
        file = data.file;
        // Redraw only what changed: a poll of a run that wrote nothing new costs no drawing.
        const changed = data.reset || data.records.length > 0 || marks.length > 0;
        const eta = JSON.stringify(data.eta);
        if (changed || eta !== shownEta) {
          setEta(progress, data.eta);
          progress.render();
          shownEta = eta;
        }
        if (changed) charts.forEach(([chart]) => chart.render());
        if (Number(costFigure.dataset.points) > 0) costFigure.hidden = false;
        setFields("#stats [data-field]", "data-field", data.run.text);
        setStatus(data.run.status);
        setWarnings(data.run.warnings);
        setConnection(null);
        if (data.run.status === "finished") delay = interval * SLOW_FACTOR;
      } catch (error) {
        setConnection(error.message);
        delay = interval * SLOW_FACTOR;
      }
      window.setTimeout(poll, delay);
    }
    poll();
  }

  function resources(body) {
    const interval = Number(body.dataset.pollMs) || 1000;
    const cpu = new LineChart(document.getElementById("chart-cpu"), [{ key: "cpu", label: "CPU" }],
      { xLabel: "seconds", yMin: 0, yMax: 100 });
    const memory = new LineChart(document.getElementById("chart-memory"), [{ key: "memory", label: "used" }],
      { xLabel: "seconds", yMin: 0, yMax: 100 });
    const start = Date.now() / 1000;

    async function poll() {
      try {
        const data = await fetchJSON("/api/system");
        const host = data.host;
        const t = host.time_unix - start;
        cpu.add("cpu", t, host.cpu_percent);
        memory.add("memory", t, host.memory_percent);
        cpu.render();
        memory.render();
        setFields("#host [data-host]", "data-host", {
          cpu: host.cpu_percent.toFixed(0) + "%",
          memory: (host.memory_used_bytes / 2 ** 30).toFixed(2) + " GiB",
          load: host.load_average ? host.load_average[0].toFixed(2) : "—",
        });
        setConnection(null);
      } catch (error) {
        setConnection(error.message);
      }
      window.setTimeout(poll, interval);
    }
    // First sample one interval after the page's own: psutil's CPU figure covers the time between two reads.
    window.setTimeout(poll, interval);
  }

  // The run list: status and latest numbers refreshed in place; a new run reloads the page to get its row.
  function runList() {
    const names = document.getElementById("run-names") ? pageData("run-names") : [];
    const rows = document.querySelectorAll("#runs tbody tr"); // in the order of `names`
    async function poll() {
      try {
        const data = await fetchJSON("/api/runs");
        for (const run of data.runs) {
          const row = rows[names.indexOf(run.name)];
          if (!row) {
            window.location.reload();
            return;
          }
          setFields("[data-field]", "data-field", { ...run.text, warnings: run.warnings.join("; ") }, row);
          const badge = row.querySelector(".badge");
          badge.textContent = run.status;
          badge.className = "badge " + run.status;
        }
      } catch (error) {
        // the next poll retries; the table keeps the last numbers read
      }
      window.setTimeout(poll, 5000);
    }
    window.setTimeout(poll, 5000);
  }

  function cost() {
    if (!document.querySelector("[data-live]")) return; // cost tracking was off: nothing changes
    const name = pageData("run-name");
    async function poll() {
      try {
        const data = await fetchJSON(`/api/runs/${encodeURIComponent(name)}/cost`);
        setFields("[data-live]", "data-live", data.live);
      } catch (error) {
        // the next poll retries; the numbers shown stay the last ones read
      }
      window.setTimeout(poll, 2000);
    }
    window.setTimeout(poll, 2000);
  }

  function checkpoints(body) {
    const refresh = Number(body.dataset.refreshMs) || 0;
    if (refresh > 0) window.setTimeout(() => window.location.reload(), refresh);
  }

  const pages = { index: runList, run: liveRun, system: resources, cost, checkpoints };
  const body = document.body;
  if (pages[body.dataset.page]) pages[body.dataset.page](body);
})();
