"""One benchmark harness shared by the benchmarks and the tests.

SGLang-free parts: `record` (result summaries under benchmarks/results/<plugin>/<name>.json),
`stats` (numpy.percentile-compatible quantiles, spread, ratio of medians), `trace` (Mooncake JSONL
traces, the format `sglang.bench_serving --dataset-name mooncake` reads), `schedule` (arrival
schedules), `progress` (a one-line progress bar), `plot` (figures, written only where matplotlib is installed),
`results_md` (benchmarks/RESULTS.md generated from the summaries). SGLang-facing: `client` (one
streaming client for SGLang's HTTP API); server lifecycle is `kllm_plugins.testing.sglang_server`.
"""
