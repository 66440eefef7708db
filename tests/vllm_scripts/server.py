"""vLLM's OpenAI server on "tpu" (run by tests/test_vllm.py in the vLLM virtualenv).

    python server.py [eager]

Starts ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with a tiny random-weight
Llama (VLLM_TARGET_DEVICE=tpu), then through the openai client: completions (greedy, a batch
of prompts sent concurrently), chat completions and streaming, each checked against
transformers' greedy continuation on CPU. The server is stopped (its process group killed) at
the end. Prints "ALL OK".
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))
sys.path.insert(0, os.path.dirname(__file__))
from openai_server import openai_server  # noqa: E402
from tiny_models import hf_greedy, save_tiny_model  # noqa: E402

eager = "eager" in sys.argv[1:]
path = save_tiny_model(tempfile.mkdtemp(prefix="tiny-llama-serve-"), "llama")
flags = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "64", "--kv-cache-memory-bytes", str(8 << 20),
         "--served-model-name", "tiny"]
if eager:
    flags.append("--enforce-eager")
with openai_server(path, *flags) as srv:
    import openai
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", timeout=120)
    N = 8
    prompts = ["the cat sat on the", "hello world how are you", "red blue green",
               "one two three four five six seven", "my friend"]

    def ref_text(ids):
        return tok.decode(hf_greedy(path, [ids], N)[0], skip_special_tokens=True)

    # completions, concurrently (the server batches them)
    def complete(p):
        r = client.completions.create(model="tiny", prompt=p, max_tokens=N, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        texts = list(ex.map(complete, prompts))
    for p, t in zip(prompts, texts):
        want = ref_text(tok(p)["input_ids"])
        assert t.strip() == want.strip(), (p, t, want)
    print("completions OK", flush=True)

    # chat completions: the chat template's tokens, continued greedily
    msgs = [{"role": "user", "content": "what is your name"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=N,
                                       temperature=0.0, extra_body={"ignore_eos": True})
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert r.choices[0].message.content.strip() == ref_text(list(ids)).strip(), \
        (r.choices[0].message.content, ref_text(list(ids)))
    print("chat OK", flush=True)

    # streaming: the chunks join to the non-streamed text
    chunks = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=N,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed.strip() == texts[0].strip(), (streamed, texts[0])
    print("streaming OK", flush=True)
print("ALL OK", flush=True)
