"""The docs' tables, one function per benchmark: its result JSON in, (detail table, README headline) out."""

from __future__ import annotations

import math

Table = list[str]


def num(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}×"


def table(header: list[str], rows: list[list[str]]) -> Table:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in rows]


def scheduler(d: dict) -> tuple[Table, str]:
    by_caching = {r["prefix_caching"]: r for r in d["results"]}
    off = by_caching.get(False)
    rows = []
    for r in d["results"]:
        vs = r["step_ms"]["mean"] / off["step_ms"]["mean"] if off else None
        rows.append(
            ["on" if r["prefix_caching"] else "off", str(r["requests"]), str(r["budget"])]
            + [num(r["step_ms"][k], 3) for k in ("mean", "p50", "p99")]
            + [num(r[k]["mean"], 3) for k in ("schedule_ms", "update_ms", "plan_to_proto_ms")]
            + [ratio(vs)]
        )
    head = ["prefix caching", "running requests", "token budget", "step ms (mean)", "p50", "p99"]
    head += ["schedule ms", "update ms", "to proto ms", "vs caching off"]
    on = by_caching.get(True, d["results"][0])
    vs_off = on["step_ms"]["mean"] / off["step_ms"]["mean"] if off else None
    headline = f"{num(on['step_ms']['mean'], 3)} ms per step at {on['requests']} running requests"
    return table(head, rows), headline + (f", {ratio(vs_off)} the step without prefix caching" if off else "")


def control_plane(d: dict) -> tuple[Table, str]:
    head = ["calls", "frontends", "delivered tok/s", "ideal tok/s", "of ideal", "step ms", "scheduler CPU ms / step"]
    head += ["frontend CPU µs / token", "tokens / response", "TTFT p50 ms", "ITL p50 / p99 ms"]
    row = [str(d["concurrency"]), str(d["frontends"]), num(d["delivered_tok_s"], 0), num(d["ideal_tok_s"], 0)]
    row += [f"{100 * d['fraction_of_ideal']:.1f}%", num(d["step_ms"], 2), num(d["scheduler_cpu_ms_per_step"], 2)]
    row += [num(d["frontend_cpu_us_per_token"]), num(d["tokens_per_response"], 2), num(d["ttft_p50_ms"])]
    row += [f"{num(d['itl_p50_ms'])} / {num(d['itl_p99_ms'])}"]
    headline = f"{100 * d['fraction_of_ideal']:.1f}% of ideal output tok/s at {d['concurrency']} concurrent calls"
    return table(head, [row]), headline


def serving(d: dict) -> tuple[Table, str]:
    head = ["shape", "stack tok/s", "worker alone tok/s", "HF tok/s", "stack / worker", "stack / HF"]
    rows, parts = [], []
    for r in d["results"]:
        rows.append([r["shape"], num(r["stack_tok_s"]), num(r["worker_tok_s"]), num(r["hf_tok_s"])])
        rows[-1] += [ratio(r["stack_over_worker"]), ratio(r["stack_over_hf"])]
        hf = f" and {ratio(r['stack_over_hf'])} HF" if r.get("stack_over_hf") else ""
        parts.append(f"{ratio(r['stack_over_worker'])} the worker alone{hf} ({r['shape']})")
    return table(head, rows), "stack " + "; ".join(parts)


def worker(d: dict) -> tuple[Table, str]:
    other = "eager tok/s" if d.get("cuda_graphs") else "torch path tok/s"
    head = ["batch", "kvgrid tok/s", other, "HF tok/s", "kvgrid / HF", f"kvgrid / {other.removesuffix(' tok/s')}"]
    rows = []
    for r in d["results"]:
        alt = r.get("kvgrid_torch_path_tok_s")
        rows.append([str(r["batch"]), num(r["kvgrid_tok_s"]), num(alt), num(r["hf_tok_s"]), ratio(r["speedup"])])
        rows[-1].append(ratio(r["kvgrid_tok_s"] / alt if alt else None))
    vs = ", ".join(f"{ratio(r['speedup'])} at batch {r['batch']}" for r in d["results"] if r.get("speedup"))
    setup = f"{d['dtype']}, --quantization {d['quantization']}"
    return table(head, rows), f"decode ({setup}) " + (f"against HF: {vs}" if vs else "with no HF side in the run")


def offline(d: dict) -> tuple[Table, str]:
    labels = {"offline": "LLM.generate (one process)", "stack": "kvgrid serve + kvgrid bench", "hf": "HF generate"}
    median = d["median_output_tok_s"]
    rows = [[labels[s], num(v), ratio(v / median["offline"])] for s, v in median.items()]
    return table(["side", "output tok/s", "vs offline"], rows), f"stack {ratio(d['stack_over_offline'])} offline"


def kv_tiers(d: dict) -> tuple[Table, str]:
    s = d["summary"]
    first = s.get("first_hit_ttft_s", {})
    vs_device = s.get("vs_device_hit", {})

    def against_device(side: str) -> str:
        v = vs_device.get(side)
        return f"{ratio(v['median'])} (first {ratio(v['first_hit'])})" if v else "-"

    rows = [
        [
            side,
            num(ttft, 3),
            num(first[side], 3) if side in first else "-",
            against_device(side),
            ratio(s["speedup_vs_recompute"][side]),
            f"{100 * s['same_first_tokens_as_recompute'][side]:.0f}%",
        ]
        for side, ttft in s["ttft_median_s"].items()
    ]
    head = [
        "side",
        "TTFT median s",
        "first hit s",
        "TTFT over a device hit",
        "lower than recompute by",
        "same first tokens",
    ]
    speedups = s["speedup_vs_recompute"]
    headline = f"TTFT {ratio(speedups.get('host'))} lower (host tier), {ratio(speedups.get('redis'))} (Redis)"
    if vs_device:
        headline += f"; over a device hit: host {against_device('host')}, Redis {against_device('redis')}"
    return table(head, rows), headline


def quant(d: dict) -> tuple[Table, str]:
    sides = list(dict.fromkeys(s for r in d["results"] for s in r["us"]))  # K-quants only where K allows
    head = ["matrix", "rows"] + [f"{s} µs" + ("" if s == "float32" else " (vs float32)") for s in sides]
    rows = []
    for r in d["results"]:
        base, us = r["us"]["float32"], r["us"]
        cells = [
            "-" if s not in us else num(us[s], 0) + ("" if s == "float32" else f" ({ratio(base / us[s])})")
            for s in sides
        ]
        rows.append([f"{r['matrix']} {r['shape'][0]}x{r['shape'][1]}", str(r["rows"]), *cells])
    one = [r for r in d["results"] if r["rows"] == 1 and "q4_1" in r["us"]]
    headline = ", ".join(f"{r['matrix']} {ratio(r['us']['float32'] / r['us']['q4_1'])}" for r in one)
    return table(head, rows), f"q4_1 against float32 at 1 row: {headline}" if one else "per-product times"


def structured(d: dict) -> tuple[Table, str]:
    rows = [
        [
            shape,
            num(d[f"{shape}_step_ms"], 2),
            num(d[f"{shape}_sampler_ms"], 3),
            ratio(d[f"{shape}_step_ms"] / d["plain_step_ms"]),
        ]
        for shape in ("plain", "constrained")
    ]
    head = ["companions", "step ms", "sampler ms", "vs plain"]
    return table(head, rows), f"step with JSON-schema companions {ratio(d['step_ratio'])} the plain step"


def http_vs_grpc(d: dict) -> tuple[Table, str]:
    keys = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms")
    rows = [[t, *(num(d[t][k]) for k in keys)] for t in ("grpc", "http")]
    rows.append(["HTTP / gRPC", *(ratio(d["http_over_grpc"].get(k)) for k in keys)])
    head = ["transport", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms"]
    return table(head, rows), f"HTTP output tok/s {ratio(d['http_over_grpc'].get('output_tok_s'))} gRPC"


def routing(d: dict) -> tuple[Table, str]:
    base = next(p for p in d["phases"] if p["policy"] == "round-robin")
    head = ["policy", "prefix hit rate", "requests/s", "vs round-robin", "TTFT p50 ms", "TTFT p99 ms"]
    rows = [
        [
            p["policy"],
            num(p["prefix_hit_rate"], 2),
            num(p["requests_per_s"], 2),
            ratio(p["requests_per_s"] / base["requests_per_s"]),
        ]
        + [num(p["ttft_p50_ms"]), num(p["ttft_p99_ms"])]
        for p in d["phases"]
    ]
    return table(head, rows), f"cache-aware routing {ratio(d['ratios']['throughput_ratio'])} round-robin's requests/s"


def tensor_parallel(d: dict) -> tuple[Table, str]:
    tok_s = d["tok_s"]
    base = next(iter(tok_s))
    batches = list(tok_s[base])
    head = ["variant"] + [f"batch {b} tok/s (vs {base})" for b in batches]
    rows = [
        [name, *(f"{num(per[b])} ({ratio(per[b] / tok_s[base][b])})" for b in batches)] for name, per in tok_s.items()
    ]
    other = [name for name in tok_s if name.startswith("tp") and name != base and "native" not in name]
    parts = [f"{n} {ratio(tok_s[n][b] / tok_s[base][b])} at batch {b}" for n in other for b in batches]
    return table(head, rows), f"against {base}: " + ", ".join(parts)


def attention(d: dict) -> tuple[Table, str]:
    torch_ms = {r["scenario"]: r["ms"] for r in d["results"] if r["impl"] == "torch"}
    head = ["scenario", "implementation", "ms", "GB/s", "of peak", "of copy", "vs torch backend"]
    rows = []
    for r in d["results"]:
        peak = f"{100 * r['fraction_of_nominal']:.0f}%" if r["fraction_of_nominal"] is not None else "-"
        vs = torch_ms[r["scenario"]] / r["ms"] if r["scenario"] in torch_ms else None
        rows.append([r["scenario"], r["impl"], num(r["ms"], 3), num(r["gb_per_s"], 0), peak])
        rows[-1] += [f"{100 * r['fraction_of_copy']:.0f}%", ratio(vs)]
    best = max(d["results"], key=lambda r: r["gb_per_s"])
    vs = torch_ms.get(best["scenario"])
    headline = f"{best['impl']}, {best['scenario']}: {num(best['gb_per_s'], 0)} GB/s"
    return table(head, rows), headline + (f", {ratio(vs / best['ms'])} the torch backend" if vs else "")


def embed(d: dict) -> tuple[Table, str]:
    a, r = d["args"], d["result"]
    tokens_per_input = r["num_prompt_tokens"] / r["inputs"]
    head = ["inputs", "lengths", "pooling", "stack embeddings/s", "transformers embeddings/s", "stack prompt tok/s"]
    head += ["stack / transformers", "lowest cosine"]
    row = [str(r["inputs"]), a["lengths"], a["pooling_type"], num(r["stack_embeddings_per_s"])]
    row += [num(r["hf_embeddings_per_s"]), num(r["stack_embeddings_per_s"] * tokens_per_input, 0)]
    row += [ratio(r["stack_over_hf"]), f"{r['min_cosine']:.6f}"]
    headline = f"{num(r['stack_embeddings_per_s'])} embeddings/s, {ratio(r['stack_over_hf'])} transformers"
    return table(head, [row]), headline + f" ({r['inputs']} inputs of {a['lengths']} tokens)"


def peers(d: dict) -> tuple[Table, str]:
    """Tok/s per side and kvgrid's ratio over each peer; files written before ``kvgrid_over`` carried
    each side's ratio over llama-server, which is kvgrid's over llama-server as well."""
    results = d["results"]
    if "kvgrid_over" not in results[0]:
        results = [r | {"kvgrid_over": {"llama-server": r["over_llama_server"].get("kvgrid")}} for r in results]
    sides = list(dict.fromkeys(side for r in results for side in r["tok_s"]))
    peers_ = list(dict.fromkeys(peer for r in results for peer in r["kvgrid_over"]))
    head = ["shape"] + [f"{side} tok/s" for side in sides] + [f"kvgrid / {peer}" for peer in peers_]
    rows = [
        [r["shape"]]
        + [num(r["tok_s"].get(side)) for side in sides]
        + [ratio(r["kvgrid_over"].get(peer)) for peer in peers_]
        for r in results
    ]
    load = d["load_average"]
    model = f"Model {d['model']}" + (f" in {d['dtype']}" if d.get("dtype", "gguf") != "gguf" else "")
    versions = "".join(f", {name} {v}" for name, v in d.get("versions", {}).items())
    bench = ", ".join(f"{b['test']} {num(b['tok_s'])} tok/s" for b in d["llama_bench"])
    bench = f"; llama-bench on the same file: {bench}" if bench else ""
    load = f"load average {load['before'][0]:.1f} before, {load['after'][0]:.1f} after"
    notes = ["", f"{model}{versions}{bench}; {load}."]
    peer = d.get("headline_peer", "llama-server")
    kv = [f"{ratio(r['kvgrid_over'].get(peer))} at {r['shape']}" for r in results]
    return table(head, rows) + notes, f"kvgrid against {peer}: {', '.join(kv)} ({d['model']})"


def lora(d: dict) -> tuple[Table, str]:
    s, r = d["summary"], d["lora_over_base"]
    head = ["requests", "adapters", "rank", "context", "base prefill ms", "LoRA prefill ms", "prefill ratio"]
    head += ["base decode step ms", "LoRA decode step ms", "decode ratio"]
    row = [str(d["requests"]), str(d["adapters"]), str(d["rank"]), str(d["context"])]
    row += [num(s["base"]["prefill_ms"]), num(s["lora"]["prefill_ms"]), ratio(r["prefill_ms"])]
    row += [num(s["base"]["decode_step_ms"], 2), num(s["lora"]["decode_step_ms"], 2), ratio(r["decode_step_ms"])]
    headline = f"{ratio(r['decode_step_ms'])} the base model's decode step with {d['adapters']} adapters in the batch"
    return table(head, [row]), headline


def speculative(d: dict) -> tuple[Table, str]:
    head = ["workload", "concurrency", "off tok/s", "speculative tok/s", "ratio", "acceptance", "accepted per draft"]
    rows = [
        [r["workload"], str(r["concurrency"]), num(r["off_tok_s"]), num(r["spec_tok_s"]), ratio(r["speedup"])]
        + [f"{r['acceptance_rate']:.0%}", num(r["mean_accepted_per_draft"], 2)]
        for r in d["rows"]
    ]
    method = d["speculative_config"]["method"]
    if d.get("draft"):
        method += f" ({d['draft']} as the draft)"
    parts = [f"{ratio(r['speedup'])} at concurrency {r['concurrency']} ({r['workload']})" for r in d["rows"]]
    return table(head, rows), f"{method} against none: " + ", ".join(parts)


def pipeline(d: dict) -> tuple[Table, str]:
    result = d["result"]
    base = next(iter(result))
    batches = list(result[base])
    head = ["variant"] + [f"batch {b}: tok/s (vs {base}), stage busy" for b in batches]
    rows = []
    for name, per in result.items():
        cells = []
        for b in batches:
            busy = " / ".join(f"{x:.0%}" for x in per[b]["stage_busy"]) or "-"
            cells.append(f"{num(per[b]['tok_s'])} ({ratio(per[b]['tok_s'] / result[base][b]['tok_s'])}), {busy}")
        rows.append([name, *cells])
    b = batches[-1]
    busy = {name: " / ".join(f"{x:.0%}" for x in per[b]["stage_busy"]) for name, per in result.items() if name != base}
    return table(head, rows), f"stages busy at batch {b}: " + ", ".join(f"{n} {v}" for n, v in busy.items())
