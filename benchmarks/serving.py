"""Continuous-batching serving: rounds of concurrent chat requests until steady state.

    python benchmarks/serving.py [--rounds 5] [--max-tokens 16]

``transformers serve --continuous-batching`` (the real server, a tiny random-weight chat model
from examples/tiny_chat_model.py, the small KV cache of tests/test_serve.py) is started with
``--device cpu``, then with ``--device tpu`` on an empty compile cache folder (cold), then
again with ``--device tpu`` on that folder (a second process: warm). Each round sends 4
concurrent chat completions (other prompts every round, ``max_tokens`` new tokens each,
greedy) and is timed from the first request to the last answer. Steady state is reached at the
first round within 1.5x of the median of the later rounds. The tpu servers' answers must equal
the CPU server's.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

WORDS = ("the cat sat on the mat", "hello world how are you", "what is your name my friend",
         "a big red dog ran far", "good day sun moon star", "the small blue house",
         "how are you today", "the sky and the sea", "green tree big house", "my friend ran fast")
CB_FLAGS = ["--cb-num-blocks", "16", "--cb-block-size", "16", "--cb-max-batch-tokens", "64"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "transformers")
    return exe if os.path.exists(exe) else shutil.which("transformers")


def _serve(model_dir, device, env, log_path, extra=()):
    port = _free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [_cli(), "serve", str(model_dir), "--device", device, "--continuous-batching",
         "--host", "127.0.0.1", "--port", str(port), *CB_FLAGS, *extra],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1", **env})
    t0 = time.monotonic()
    while time.monotonic() - t0 < 600:
        if proc.poll() is not None:
            raise RuntimeError(f"{device} server exited: see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return proc, port, log, time.monotonic() - t0
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{device} server not up after 600 s")


def _rounds(port, model, rounds, max_tokens):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           timeout=600, max_retries=0)

    def one(prompt):
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens, temperature=0)
        return r.choices[0].message.content

    times, texts = [], []
    for k in range(rounds):
        prompts = [WORDS[(4 * k + i) % len(WORDS)] for i in range(4)]
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            texts.append(list(ex.map(one, prompts)))
        times.append(time.perf_counter() - t0)
    return times, texts


def _steady(times) -> int:
    """The first round (1-based) within 1.5x of the median of the rounds after it."""
    for i in range(len(times) - 1):
        if times[i] <= 1.5 * statistics.median(times[i + 1:]):
            return i + 1
    return len(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--cpu-only", action="store_true", help="only the CPU server (a check)")
    ap.add_argument("--compile", action="store_true",
                    help="tpu servers with --compile (transformers then pads batches to buckets)")
    a = ap.parse_args()
    path = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "tiny_chat_model.py")
    spec = importlib.util.spec_from_file_location("tiny_chat_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "tiny-chat")
        mod.save_tiny_chat_model(model_dir)
        cache = os.path.join(tmp, "cache")
        rows, answers = [], {}
        for name, device, env in (("cpu", "cpu", {}),
                                  ("tpu, empty cache (cold)", "tpu", {"TORCHTPU_CACHE_DIR": cache}),
                                  ("tpu, second process (warm)", "tpu",
                                   {"TORCHTPU_CACHE_DIR": cache}))[:1 if a.cpu_only else 3]:
            extra = ["--compile"] if a.compile and device == "tpu" else []
            proc, port, log, startup = _serve(model_dir, device, env,
                                              os.path.join(tmp, f"{device}.log"), extra)
            try:
                times, texts = _rounds(port, model_dir, a.rounds, a.max_tokens)
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                log.close()
            answers[name] = texts
            rows.append((name, startup, times))
    cpu_steady = statistics.median(rows[0][2][1:])
    print(f"{a.rounds} rounds of 4 concurrent chat completions, {a.max_tokens} new tokens each")
    print(f"{'server':28} {'startup s':>9}  {'round times (s)':40} {'steady from':>11} "
          f"{'steady / CPU':>12}")
    for name, startup, times in rows:
        steady = statistics.median(times[1:])
        print(f"{name:28} {startup:9.1f}  {' '.join(f'{t:.2f}' for t in times):40} "
              f"{'round ' + str(_steady(times)):>11} {steady / cpu_steady:12.2f}")
    for name in answers:
        if answers[name] != answers["cpu"]:
            print(f"ANSWERS DIFFER: {name} vs cpu")
            sys.exit(1)
    print("answers: tpu == cpu in every round")


if __name__ == "__main__":
    main()
