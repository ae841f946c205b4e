"""The cells of analysis/notebooks/walkthrough.ipynb: ``main`` writes them, unexecuted, to ``TARGET``.

The committed notebook is these cells executed on the sample campaign, with their outputs; write it with
``.venv/bin/python -m tests.test_notebook`` (which calls this and executes the result), not by running
this file alone. tests/test_notebook.py checks that the committed cells are these and runs them again.
"""

from __future__ import annotations

from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / "analysis" / "notebooks" / "walkthrough.ipynb"

CELLS: list[tuple[str, str]] = [
    ("markdown", """# Walkthrough: from a campaign directory to the papers' metrics

This notebook reads `tests/data/sample-campaign/`, a small campaign that really ran on the emulated
testbed (network namespaces, real HTB shaping, real MPI ranks, modeled Jetson power):

```
testbed emulate up -i inventory.yaml
testbed run examples/campaigns/analysis-sample.yaml --out tests/data/sample-campaign
testbed emulate down -i inventory.yaml
```

U-shape and centralized inference of the tiny model, at 0.5 and 4 requests/s per device, with the
orin at MAXN and at MODE_30W: 8 runs, 5 requests per device each. Point `CAMPAIGN` at your own
campaign's `--out` directory to analyse it the same way."""),
    ("code", """from pathlib import Path

import pandas as pd

import analysis
from analysis import load, metrics

CAMPAIGN = Path(analysis.__file__).resolve().parent.parent / "tests" / "data" / "sample-campaign"
data = load(CAMPAIGN)
pd.set_option("display.width", 160)
data.runs[["run_id", "state", "method", "workload.rate_per_s", "power.orin"]]"""),
    ("markdown", """`load` gives five DataFrames. `requests` has one row per scheduled request; its times are
seconds on the issuing device's monotonic clock from the run's start barrier, and the `*_ts_s`
columns are the same instants on the controller's clock (for lining up with telemetry).
`tokens` has one row per delivered token."""),
    ("code", """print({name: len(getattr(data, name)) for name in ["runs", "requests", "tokens", "telemetry"]})
data.requests[["run_id", "node", "request_id", "prompt_tokens", "output_tokens", "arrival_s", "first_token_s",
               "expected_ttft_s", "expected_tds_tok_s"]].head()"""),
    ("markdown", """## Latency: TTFT, TBT, TPOT (HAT Table 5 layout)

TTFT is first token minus arrival; TBT is every gap between consecutive tokens of a request."""),
    ("code", """by = ["method", "workload.rate_per_s"]
metrics.latency_table(data.requests, data.tokens, data.runs, by=by).round(1)"""),
    ("markdown", """## HAT's SLA compliance

Prefill SLA: TTFT per 128 prompt tokens. Decode SLA: decode time per 10 generated tokens. The share
of requests that meet a few SLAs, by method:"""),
    ("code", """lat = metrics.request_latencies(data.requests).merge(data.runs[["run_id", "method"]])
slas_s = [0.05, 0.1, 0.2]
pd.DataFrame({m: metrics.sla_compliance(g["prefill_delay_per_128_s"], slas_s) for m, g in lat.groupby("method")},
             index=[f"prefill SLA {s * 1e3:g} ms" for s in slas_s])"""),
    ("markdown", """## Andes QoE (Eq. 1)

`qoe_table` computes every request's QoE from its token timeline at once; `qoe` is the same
definition for one timeline, handy for checking a single request by hand."""),
    ("code", """q = metrics.qoe_table(data.requests, data.tokens)
q = q.merge(data.runs[["run_id", "method", "workload.rate_per_s"]])
one = data.requests[data.requests.completed].iloc[0]
mine = (data.tokens.run_id == one.run_id) & (data.tokens.request_id == one.request_id)
times = data.tokens[mine].ts_s - one.arrival_s
print("one request:", metrics.qoe(times, one.expected_ttft_s, one.expected_tds_tok_s))
q.groupby(["method", "workload.rate_per_s"])["qoe"].mean()"""),
    ("markdown", """The tiny model streams far faster than a reader's 4.8 tokens/s, so at 0.5 requests/s every
request scores 1. At 4 requests/s requests queue on their device, and a first token later than the
expected second pulls QoE down however fast the rest streams. The same timeline delivered two
seconds later:"""),
    ("code", """metrics.qoe(times + 2.0, one.expected_ttft_s, one.expected_tds_tok_s)"""),
    ("markdown", """## Energy per token

`node_power` takes each node's total power (a Jetson's board total, or the sum of a server's
sensors); `request_energy` integrates it over each request's prefill and decode windows on the
controller's clock. The emulated boards' power is *modeled*: the `kind` column says so, and
measured and modeled energy are never added together."""),
    ("code", """power = metrics.node_power(data.telemetry)
energy = metrics.request_energy(data.requests, power).merge(data.runs[["run_id", "power.orin"]])
per_token = energy.groupby(["energy_node", "role", "power.orin", "kind"])[["energy_j", "output_tokens"]].sum()
(per_token.energy_j / per_token.output_tokens * 1e3).rename("mJ per token").round(2)"""),
    ("markdown", """## DiSCo cost per request

FLOPs per token from DiSCo's Eq. 7-9 on the tiny model's shape; the device's FLOPs at 0.3 USD per
10^15 FLOPs and the server's share of the request at GPT-4o-mini's price (DiSCo Table 8)."""),
    ("code", """from analysis.cost_model import ModelShape

shape = ModelShape.from_model_dir(Path(analysis.__file__).resolve().parent.parent / "examples" / "models" / "tiny")
cost = metrics.request_cost(data.requests, data.runs, shape, api="gpt-4o-mini", device_usd_per_pflop=0.3)
(cost.merge(data.runs[["run_id", "method"]]).groupby("method")[["device_usd", "server_usd"]].mean() * 1e6).round(3)"""),
    ("markdown", """## A figure, and the whole report

Every figure of `testbed report` is a function in `analysis.plots`. The report itself writes
markdown, PNGs and CSVs into `<campaign>/report/`; here into a copy, to leave the sample untouched."""),
    ("code", """%matplotlib inline
from analysis import plots

run = data.runs.run_id.iloc[0]
plots.delivery_curves(data.tokens[data.tokens.run_id == run], data.requests[data.requests.run_id == run])"""),
    ("code", """import shutil
import tempfile

from analysis.report import build_report

with tempfile.TemporaryDirectory() as tmp:
    copy = Path(shutil.copytree(CAMPAIGN, Path(tmp) / "campaign"))
    report = build_report(copy)
    print(sorted(p.name for p in report.parent.iterdir()))
    print(report.read_text()[:600])"""),
]


def main() -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, source in CELLS:
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        notebook.cells.append(make(source))
    for i, cell in enumerate(notebook.cells):
        cell["id"] = f"cell-{i:02d}"  # stable ids keep the file's diff small
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, TARGET)
    print(TARGET)


if __name__ == "__main__":
    main()
