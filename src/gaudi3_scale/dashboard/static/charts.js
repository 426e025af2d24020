// Line charts drawn as SVG: a few series of (x, y) points that grow as a run trains. Our own code, no library.
//
// A chart lives in a <figure class="chart" data-title="…">; it keeps every point, draws at most MAX_DRAWN per
// series (every k-th point plus the last: enough for a curve on a 640-unit-wide plot) and sets the figure's
// data-points to the number of points it holds, for people and tests.
//
// A value that was NaN or infinite (a diverged loss) arrives spelled as a string, "NaN", "Infinity" or "-Infinity"
// (the server's JSON is strict: config/strict_json.py). It is kept in its place: the series' line stops before it
// and starts again after it, and a dashed vertical line labelled with the value marks its x (a <g class="gap">
// with data-step, data-value and data-x); the figure's data-gaps counts them.
//
// A chart may also carry marks of training-health events (`addMark`, from the metrics API's health_marks, classified
// on the server by health/marks.py as loss.png's are): a vertical line at the event's step, drawn under the curves,
// dotted red for a dropped update, dashed orange for a spike, solid purple for a rollback with the steps it went
// back over shaded (a <g class="health-mark MARK"> with data-step, data-mark, data-event, data-x, and for a rollback
// data-from-step and data-to-step). Each mark's <title> says what it is; the legend names the kinds present; the
// figure's data-marks counts them. At most MAX_MARKS_DRAWN are drawn (every k-th and the last, as points are
// thinned: a run that warned of a spike at every step would otherwise be a wall of lines); data-marks-drawn says
// how many.
//
// A point at or before a series' last x means the run went back (a rollback, a resume from an earlier checkpoint)
// and trains those steps again: as on loss.png, the series keeps each step's newest value.
//
// A series may be `dashed` (a forecast beside a measurement: the progress chart's predicted line) and may be set
// whole (`replace`) rather than grown point by point.
"use strict";

(function () {
  const SVG_NS = "http://www.w3.org/2000/svg";
  const WIDTH = 520;
  const HEIGHT = 240;
  const MARGIN = { left: 58, right: 14, top: 12, bottom: 28 };
  const MAX_DRAWN = 1500;
  const MAX_MARKS_DRAWN = 200;
  const TICKS = 5;
  const NON_FINITE = new Set(["NaN", "Infinity", "-Infinity"]);

  const isGap = (point) => typeof point[1] === "string";
  const MARK_GLYPHS = { dropped: "×", spike: "!", rollback: "↶" };

  function svgElement(name, attributes, parent) {
    const element = document.createElementNS(SVG_NS, name);
    for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, String(value));
    if (parent) parent.appendChild(element);
    return element;
  }

  // A tick label as precise as the tick spacing needs: 12500 → "12.5k", 0.25 → "0.25", 0.4 (percent) → "40%".
  function formatNumber(value, kind, step) {
    if (kind === "percent") return formatNumber(value * 100, "number", (step || 0) * 100) + "%";
    const abs = Math.abs(value);
    for (const [scale, suffix] of [[1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
      if (abs >= scale) return formatNumber(value / scale, "number", (step || 0) / scale) + suffix;
    }
    if (abs !== 0 && abs < 1e-3) return value.toExponential(1);
    const decimals = step ? Math.min(6, Math.max(0, -Math.floor(Math.log10(step) + 1e-9))) : 2;
    return Number(value.toFixed(decimals)).toString();
  }

  // Ticks at 1, 2 or 5 × 10^k spacing inside [low, high] (so steps read 0, 100, 200 …, not 0, 97.5, 195 …).
  function niceTicks(low, high, count) {
    const raw = (high - low) / count;
    const magnitude = 10 ** Math.floor(Math.log10(raw));
    const norm = raw / magnitude;
    const step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * magnitude;
    const ticks = [];
    for (let v = Math.ceil(low / step) * step; v <= high + step * 1e-9; v += step) ticks.push(v);
    return { ticks, step };
  }

  // At most about `max` of `items`: every k-th, those `keep` says to, and the last.
  function thinned(items, max, keep = () => false) {
    if (items.length <= max) return items;
    const stride = Math.ceil(items.length / max);
    const kept = items.filter((item, i) => i % stride === 0 || keep(item));
    if (kept[kept.length - 1] !== items[items.length - 1]) kept.push(items[items.length - 1]);
    return kept;
  }

  const drawn = (points) => thinned(points, MAX_DRAWN, isGap); // never thin out a gap

  // The runs of finite points between gaps: each is drawn as a line of its own.
  function segments(points) {
    const runs = [[]];
    for (const p of points) {
      if (isGap(p)) runs.push([]);
      else runs[runs.length - 1].push(p);
    }
    return runs.filter((run) => run.length > 0);
  }

  function bounds(values, fixedLow, fixedHigh) {
    let low = fixedLow === undefined ? Infinity : fixedLow;
    let high = fixedHigh === undefined ? -Infinity : fixedHigh;
    for (const value of values) {
      if (value < low) low = value;
      if (value > high) high = value;
    }
    if (low === high) {
      const pad = Math.abs(low) * 0.1 || 1;
      low -= pad;
      high += pad;
    }
    return [low, high];
  }

  class LineChart {
    // series: [{key, label, markers, dashed}]; options: {yFormat: "number" | "percent", yMin, yMax, xLabel}
    constructor(figure, series, options) {
      this.figure = figure;
      this.series = series;
      this.options = options || {};
      this.points = new Map(series.map((s) => [s.key, []]));
      this.marks = [];
      const caption = document.createElement("figcaption");
      caption.textContent = figure.dataset.title || "";
      const legend = document.createElement("span");
      legend.className = "legend";
      series.forEach((s, i) => {
        const swatch = document.createElement("span");
        swatch.className = "swatch s" + i + (s.dashed ? " dashed" : "");
        legend.appendChild(swatch);
        legend.appendChild(document.createTextNode(s.label));
      });
      this.markLegend = document.createElement("span");
      this.markLegend.className = "mark-legend";
      legend.appendChild(this.markLegend);
      if (this.options.xLabel) legend.appendChild(document.createTextNode("  · x: " + this.options.xLabel));
      caption.appendChild(legend);
      figure.replaceChildren(caption);
      this.svg = svgElement("svg", { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, role: "img" }, figure);
      this.svg.setAttribute("aria-label", figure.dataset.title || "chart");
      this.render();
    }

    add(key, x, y) {
      const value = typeof y === "number" && isFinite(y);
      if (typeof x !== "number" || !isFinite(x) || !(value || NON_FINITE.has(y))) return false;
      const points = this.points.get(key);
      while (points.length > 0 && points[points.length - 1][0] >= x) points.pop(); // went back: newest wins
      points.push([x, y]);
      return true;
    }

    // The whole series `key`: [[x, y], …] in increasing x (points that are not numbers are left out).
    replace(key, points) {
      this.points.get(key).length = 0;
      for (const [x, y] of points) this.add(key, x, y);
    }

    // mark: {step, at, mark: "dropped" | "spike" | "rollback", event, label, help, detail, from_step?, to_step?};
    // `at` is where it is drawn (health.marks.mark_position: a record's step is the update count before its event)
    addMark(mark) {
      if (typeof mark.step !== "number" || !isFinite(mark.step) || !(mark.mark in MARK_GLYPHS)) return false;
      if (typeof mark.at !== "number" || !isFinite(mark.at)) mark = { ...mark, at: mark.step };
      this.marks.push(mark);
      return true;
    }

    clear() {
      for (const points of this.points.values()) points.length = 0;
      this.marks.length = 0;
    }

    count(gaps = false) {
      let total = 0;
      for (const points of this.points.values()) total += points.filter((p) => isGap(p) === gaps).length;
      return total;
    }

    render() {
      const svg = this.svg;
      svg.replaceChildren();
      this.figure.dataset.points = String(this.count());
      this.figure.dataset.gaps = String(this.count(true));
      this.figure.dataset.marks = String(this.marks.length);
      const marks = thinned(this.marks, MAX_MARKS_DRAWN);
      this.figure.dataset.marksDrawn = String(marks.length);
      this.renderMarkLegend();
      const all = [...this.points.values()].flat();
      const left = MARGIN.left;
      const right = WIDTH - MARGIN.right;
      const top = MARGIN.top;
      const bottom = HEIGHT - MARGIN.bottom;
      svgElement("line", { x1: left, y1: bottom, x2: right, y2: bottom, class: "axis" }, svg);
      if (all.length === 0) {
        svgElement("text", { x: (left + right) / 2, y: (top + bottom) / 2, "text-anchor": "middle", class: "empty" }, svg)
          .textContent = "waiting for metrics…";
        return;
      }
      const o = this.options;
      const markSteps = marks.flatMap((m) => [m.at, m.to_step]).filter((x) => typeof x === "number");
      const [x0, x1] = bounds([...all.map((p) => p[0]), ...markSteps]);
      const values = all.filter((p) => !isGap(p)).map((p) => p[1]);
      let [y0, y1] = bounds(values.length ? values : [0], o.yMin, o.yMax); // only gaps so far: any y scale
      if (o.yMin === undefined) y0 -= (y1 - y0) * 0.05;
      if (o.yMax === undefined) y1 += (y1 - y0) * 0.05;
      const sx = (x) => left + ((x - x0) / (x1 - x0)) * (right - left);
      const sy = (y) => bottom - ((y - y0) / (y1 - y0)) * (bottom - top);
      const yTicks = niceTicks(y0, y1, TICKS);
      for (const y of yTicks.ticks) {
        svgElement("line", { x1: left, y1: sy(y), x2: right, y2: sy(y), class: "grid" }, svg);
        svgElement("text", { x: left - 6, y: sy(y) + 4, "text-anchor": "end", class: "tick" }, svg)
          .textContent = formatNumber(y, o.yFormat, yTicks.step);
      }
      const xTicks = niceTicks(x0, x1, TICKS);
      for (const x of xTicks.ticks) {
        svgElement("text", { x: sx(x), y: bottom + 18, "text-anchor": "middle", class: "tick" }, svg)
          .textContent = formatNumber(x, "number", xTicks.step);
      }
      for (const mark of marks) this.drawMark(mark, sx, top, bottom);
      this.series.forEach((s, i) => {
        const points = drawn(this.points.get(s.key));
        for (const run of segments(points)) {
          if (run.length > 1) {
            const path = run.map((p) => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" ");
            svgElement("polyline", { points: path, class: "line s" + i + (s.dashed ? " dashed" : "") }, svg);
          }
          if (s.markers || run.length === 1) {
            for (const p of run) svgElement("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 3, class: "marker s" + i }, svg);
          }
        }
        for (const p of points.filter(isGap)) this.drawGap(p, s, i, sx(p[0]), top, bottom);
      });
    }

    // A dashed line across the plot at the gap's x, labelled with the value (at the bottom for -Infinity).
    drawGap([x, value], s, i, at, top, bottom) {
      const group = svgElement("g", { class: "gap s" + i, "data-step": x, "data-value": value, "data-x": at.toFixed(1) },
        this.svg);
      svgElement("line", { x1: at, y1: top, x2: at, y2: bottom }, group);
      const y = value === "-Infinity" ? bottom - 4 - 12 * i : top + 10 + 12 * i; // series apart
      svgElement("text", { x: at + 3, y }, group).textContent = value;
      const where = this.options.xLabel ? this.options.xLabel + " " + x : "x = " + x;
      svgElement("title", {}, group).textContent = `${s.label}: ${value} at ${where}`;
    }

    // A health event: a line where it happened (a rollback: a band back to the step it restored, and a line there
    // too), a glyph at the top, and a title saying what it is.
    drawMark(mark, sx, top, bottom) {
      const at = sx(mark.at);
      const group = svgElement("g", { class: "health-mark " + mark.mark, "data-step": mark.step, "data-mark": mark.mark,
        "data-event": mark.event, "data-x": at.toFixed(1) }, this.svg);
      let glyph = MARK_GLYPHS[mark.mark];
      if (mark.mark === "rollback" && typeof mark.to_step === "number") {
        const back = sx(mark.to_step);
        group.setAttribute("data-from-step", mark.from_step);
        group.setAttribute("data-to-step", mark.to_step);
        svgElement("rect", { x: Math.min(back, at), y: top, width: Math.abs(at - back), height: bottom - top,
          class: "span" }, group);
        svgElement("line", { x1: back, y1: top, x2: back, y2: bottom, class: "to" }, group);
        glyph += " " + mark.to_step;
      }
      svgElement("line", { x1: at, y1: top, x2: at, y2: bottom }, group);
      svgElement("text", { x: at + 3, y: top + 10 }, group).textContent = glyph;
      const where = this.options.xLabel ? this.options.xLabel + " " + mark.step : "x = " + mark.step;
      svgElement("title", {}, group).textContent = `${mark.label} at ${where}: ${mark.detail} (${mark.help})`;
    }

    // The legend's entries for the kinds of marks present, in a fixed order, each with its meaning on hover.
    renderMarkLegend() {
      const entries = [];
      for (const kind of Object.keys(MARK_GLYPHS)) {
        const mark = this.marks.find((m) => m.mark === kind);
        if (!mark) continue;
        const entry = document.createElement("span");
        entry.className = "mark-entry " + kind;
        entry.dataset.mark = kind;
        entry.title = mark.help;
        const swatch = document.createElement("span");
        swatch.className = "swatch mark " + kind;
        entry.append(swatch, document.createTextNode(mark.label));
        entries.push(entry);
      }
      this.markLegend.replaceChildren(...entries);
    }
  }

  async function fetchJSON(url) {
    const response = await fetch(url, { credentials: "same-origin", cache: "no-store" });
    if (!response.ok) {
      let message = response.status + " " + response.statusText;
      try {
        message = (await response.json()).error || message;
      } catch (ignored) {
        // not JSON (a proxy's page): the status line says enough
      }
      throw new Error(message);
    }
    return response.json();
  }

  window.Gaudi3 = { LineChart, fetchJSON, formatNumber };
})();
