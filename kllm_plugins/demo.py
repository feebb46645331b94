"""Layer: host tooling. The README's main job: serve a model through real SGLang on this
machine's CPU with plugins enabled, ask it one question, print the answer and what the
plugins saw."""
from __future__ import annotations

import json
import time

from kllm_plugins.testing.sglang_server import SGLangServer


RANDOM_MODEL_NOTE = (
    "note: the tiny model has random weights (seeded, built offline), so this answer is noise; it shows "
    "that SGLang served the request through the plugins, not what a model would say (use --model smollm2)"
)


def run_demo(model: str, plugins: str, question: str) -> int:
    if model == "tiny":
        from kllm_plugins.models.tiny_llama import tiny_llama_path as build
    else:
        from kllm_plugins.models.smollm2 import smollm2_path as build
    path = build()
    names = [p for p in plugins.split(",") if p]
    print(f"model: {path}\nplugins: {names}\nstarting sglang.launch_server on the kllm_cpu platform ...", flush=True)
    t0 = time.monotonic()
    with SGLangServer(path, plugins=names, extra_args=["--chunked-prefill-size", "64"]) as server:
        print(f"server ready in {time.monotonic() - t0:.1f}s at {server.base_url}", flush=True)
        for line in server.grep_log(r"kllm-plugins .* active"):
            print("  " + line.strip())
        t1 = time.monotonic()
        reply = server.post_json(
            "/v1/chat/completions",
            {
                "model": "default",
                "messages": [{"role": "user", "content": question}],
                "max_tokens": 32,
                "temperature": 0,
            },
        )
        answer = reply["choices"][0]["message"]["content"]
        print(f"\nQ: {question}\nA: {answer}\n({time.monotonic() - t1:.2f}s)")
        if model == "tiny":
            print(RANDOM_MODEL_NOTE)
        time.sleep(0.5)
        info = server.get_json("/kllm/plugins")
        print(f"hooks: {sum(h['ok'] for h in info['hooks'])}/{len(info['hooks'])} attached")
        stats = server.get_json("/kllm/stats")
        for name, entry in stats.items():
            print(f"{name} stats: {json.dumps(entry['total'])}")
    return 0
