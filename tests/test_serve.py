"""python -m jaxspec.serve: the OpenAI API over continuously batched speculative generation, talked to with the
`openai` client on a loopback port. Outputs equal the engine's for each prompt alone; concurrent clients get their
own; a disconnect frees its slot; bad requests get 4xx JSON errors and the server keeps serving."""

import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from hf_tiny import make_tiny, write_char_tokenizer

from jaxspec.grammar import Grammar, GrammarCompiler
from jaxspec.processors import LogitProcessors
from jaxspec.sampling import SamplingConfig
from jaxspec.serve.__main__ import build_parser, build_server

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from fit_head import head_config_for
    from flax import nnx
    from transformers import AutoTokenizer

    from jaxspec.checkpoints.heads import export_head
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.models.eagle3 import Eagle3Head

    path = tmp_path_factory.mktemp("serve") / "target"
    make_tiny("smollm2_tied", path, seed=5)
    write_char_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    model = load_target(path)
    head = path.parent / "head"
    export_head(Eagle3Head(head_config_for(model), rngs=nnx.Rngs(0)), head, layout="sglang", target=model.config,
                dtype="float32")
    return path, head


@pytest.fixture(scope="module")
def server(target):
    """The server with the tiny target and a (random) EAGLE-3 head, chains of 3, 4 slots, in this process; prompts
    over 16 tokens joining while others run are prefilled in chunks of 16."""
    from jaxspec.bench.serve_load import InProcessServer

    path, head = target
    with InProcessServer(["--target", str(path), "--draft", str(head), "--num-speculative-tokens", "3",
                          "--slots", "4", "--max-model-len", "256", "--prefill-chunk", "16"]) as running:
        yield running.base, running.app, running.scheduler


@pytest.fixture(scope="module")
def alone(target):
    """text(prompt_ids, max_tokens): what the engine gives a prompt alone (batch 1, the same head and chain)."""
    from jaxspec.checkpoints.heads import load_head
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.engine.generator import SpeculativeGenerator
    from jaxspec.prompts import load_tokenizer, stop_token_ids

    path, head_dir = target
    model = load_target(path)
    tokenizer = load_tokenizer(path)
    gen = SpeculativeGenerator(model, load_head(head_dir, model.config), num_draft=3, batch_size=1)
    stops = stop_token_ids(tokenizer, path, model.config.eos_token_ids)

    grammars = GrammarCompiler(tokenizer, model.config.vocab_size, stops)

    def text(ids: list[int], max_tokens: int, sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
             grammar: Grammar | None = None) -> str:
        processors = LogitProcessors(grammar=None if grammar is None else grammars(grammar))
        out = gen.generate([ids], max_new_tokens=max_tokens, stop_ids=stops, sampling=sampling, seed=seed,
                           processors=processors)[0].token_ids
        return tokenizer.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    return text, tokenizer


def client(base: str):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)


def post(base: str, route: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(base + route, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_completions_and_chat_equal_the_engine_alone_streamed_or_not(server, alone):
    base, _, _ = server
    text, tokenizer = alone
    api = client(base)
    for prompt, n in (("abc", 12), ("hello there", 7)):
        got = api.completions.create(model="target", prompt=prompt, max_tokens=n)
        assert got.choices[0].text == text(tokenizer(prompt).input_ids, n)
        assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens <= n
        streamed = "".join(c.choices[0].text for c in api.completions.create(
            model="target", prompt=prompt, max_tokens=n, stream=True))
        assert streamed == got.choices[0].text
    messages = [{"role": "user", "content": "what is x?"}]
    ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False).input_ids
    chat = api.chat.completions.create(model="target", messages=messages, max_tokens=10)
    assert chat.choices[0].message.content == text(ids, 10) and chat.choices[0].finish_reason in ("stop", "length")
    chunks = list(api.chat.completions.create(model="target", messages=messages, max_tokens=10, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    # a stop string cuts the text where it first occurs, streamed or not
    full = text(tokenizer("abc").input_ids, 12)
    stop = full[3:5]
    cut = api.completions.create(model="target", prompt="abc", max_tokens=12, stop=[stop])
    assert cut.choices[0].text == full[: full.find(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens == full.find(stop) + len(stop)  # one token a character: up to the stop's end
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model="target", prompt="abc", max_tokens=12, stop=stop, stream=True))
    assert streamed == cut.choices[0].text
    assert [m.id for m in api.models.list().data] == ["target"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "what "}, {"type": "text", "text": "is x?"}]}]
    assert api.chat.completions.create(model="target", messages=parts, max_tokens=10).choices[0].message.content == \
        chat.choices[0].message.content


def test_logprobs_are_the_target_onlys_bit_for_bit_streamed_or_not(target, server):
    """Completions' `logprobs` and chat's `logprobs`/`top_logprobs`: each token's log-probability under the target
    and its likeliest alternatives, under speculation (the server: a head, chains of 3) the very floats target-only
    generation gives (invariant numerics: a verify's logits are a decode's); streamed chunks carry the same, and a
    stop string cuts them where it cuts the tokens."""
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.engine.generation import Generator
    from jaxspec.prompts import load_tokenizer, stop_token_ids

    base, _, _ = server
    path, _ = target
    model, tokenizer = load_target(path), load_tokenizer(path)
    stops = stop_token_ids(tokenizer, path, model.config.eos_token_ids)
    plain = Generator(model, batch_size=1, logprobs=3)
    want = plain.generate([tokenizer("abc").input_ids], max_new_tokens=10, stop_ids=stops)[0]
    api = client(base)
    got = api.completions.create(model="target", prompt="abc", max_tokens=10, logprobs=3).choices[0].logprobs
    assert got.token_logprobs == [t.logprob for t in want.logprobs]
    assert got.tokens == [tokenizer.decode([t.token]) for t in want.logprobs]
    assert [list(d.values()) for d in got.top_logprobs] == [[lp for _, lp in t.top] for t in want.logprobs]
    assert got.text_offset == list(range(len(got.tokens)))  # one character a token
    streamed = [c.choices[0].logprobs for c in api.completions.create(
        model="target", prompt="abc", max_tokens=10, logprobs=3, stream=True) if c.choices[0].logprobs]
    assert sum((c.token_logprobs for c in streamed), []) == got.token_logprobs
    text = "".join(got.tokens)
    stop = text[2:4]
    used = text.find(stop) + len(stop)  # one character a token: the tokens up to the stop string's end
    cut = api.completions.create(model="target", prompt="abc", max_tokens=10, logprobs=0, stop=[stop]).choices[0]
    assert cut.logprobs.token_logprobs == got.token_logprobs[:used] and cut.logprobs.top_logprobs is None

    messages = [{"role": "user", "content": "what is x?"}]
    ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False).input_ids
    want = plain.generate([ids], max_new_tokens=8, stop_ids=stops)[0]
    chat = api.chat.completions.create(model="target", messages=messages, max_tokens=8, logprobs=True,
                                       top_logprobs=2).choices[0].logprobs.content
    assert [c.logprob for c in chat] == [t.logprob for t in want.logprobs]
    assert [[a.logprob for a in c.top_logprobs] for c in chat] == [[lp for _, lp in t.top[:2]] for t in want.logprobs]
    assert all(c.bytes == list(c.token.encode()) for c in chat)
    chunks = api.chat.completions.create(model="target", messages=messages, max_tokens=8, logprobs=True, stream=True)
    assert [c.logprob for k in chunks if k.choices and k.choices[0].logprobs
            for c in k.choices[0].logprobs.content] == [c.logprob for c in chat]
    status, reply = post(base, "/v1/chat/completions", json.dumps(
        {"messages": messages, "top_logprobs": 2}).encode())
    assert status == 400 and "top_logprobs needs logprobs: true" in reply["error"]["message"]
    status, reply = post(base, "/v1/completions", b'{"prompt": "a", "logprobs": 9}')
    assert status == 400 and "at most 5 top logprobs" in reply["error"]["message"]


def test_a_small_draft_model_serves_the_targets_text_on_a_mesh(target):
    """`--proposer draft-model`: a draft model (here the target itself: whole chains accepted) with its own cache per
    slot, on a (data 2, model 2) mesh of this host's devices; two requests at once, each its target-only greedy
    text, their steps on 2 of the 4 slots (a bucket of rows split over the data axis)."""
    from jaxspec.bench.serve_load import InProcessServer
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.engine.generation import Generator
    from jaxspec.prompts import load_tokenizer, stop_token_ids

    path, _ = target
    model, tokenizer = load_target(path), load_tokenizer(path)
    stops = stop_token_ids(tokenizer, path, model.config.eos_token_ids)
    alone = Generator(model, batch_size=1)
    prompts = {"abc": 12, "hello there": 9}
    want = {p: tokenizer.decode(alone.generate([tokenizer(p).input_ids], max_new_tokens=n, stop_ids=stops)[0].token_ids,
                                skip_special_tokens=True, clean_up_tokenization_spaces=False) for p, n in prompts.items()}
    with InProcessServer(["--target", str(path), "--proposer", "draft-model", "--draft-model", str(path),
                          "--num-speculative-tokens", "3", "--slots", "4", "--max-model-len", "64",
                          "--mesh", "data=2,model=2"]) as running:
        generator = running.scheduler.batcher.generator
        assert generator.proposer.name == "draft-model+lookup" and generator.mesh.shape == {"data": 2, "model": 2}
        api = client(running.base)
        with ThreadPoolExecutor(2) as pool:
            got = dict(zip(prompts, pool.map(
                lambda p: api.completions.create(model="target", prompt=p, max_tokens=prompts[p]).choices[0].text,
                prompts)))
        assert got == want
        assert set(running.scheduler.batcher.step_rows) == {2}, running.scheduler.batcher.step_rows


def test_concurrent_clients_each_get_their_own_output(server, alone):
    base, _, scheduler = server
    text, tokenizer = alone
    prompts = [("abc", 9), ("hello there", 4), ("x", 14), ("the quick fox", 6),
               ("a long prompt: it joins in chunks of 16 while the others run", 5)]
    want = {p: text(tokenizer(p).input_ids, n) for p, n in prompts}
    api = client(base)

    def ask(i):
        p, n = prompts[i % len(prompts)]
        return p, api.completions.create(model="target", prompt=p, max_tokens=n).choices[0].text

    before, chunks_before = scheduler.batcher.prefill_rows.copy(), scheduler.batcher.prefill_chunks
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(ask, range(32)))
    assert all(got == want[p] for p, got in results)
    assert scheduler.stats.joins >= 32 and scheduler.running == 0
    joins = scheduler.batcher.prefill_rows - before  # rows per join prefill: the joining ones (tests/test_slots.py)
    assert sum(n * c for n, c in joins.items()) >= 32, joins
    assert scheduler.batcher.prefill_chunks > chunks_before  # the long prompt joined running states in chunks


def test_each_request_samples_with_its_own_settings_and_seed(server, alone):
    """Sampled and greedy requests share the running batch: a seeded request gets what the engine gives its prompt
    alone with that seed and those settings, whoever runs beside it; greedy ones stay greedy's output."""
    base, _, _ = server
    text, tokenizer = alone
    api = client(base)
    hot = dict(temperature=1.3, top_p=0.95, top_k=40)
    asks = [("abc", 12, hot, 7), ("abc", 12, hot, 7), ("hello there", 10, hot, 8), ("x", 12, {}, None),
            ("the quick fox", 9, dict(temperature=0.9, top_k=-1), 9), ("x", 12, dict(temperature=0), 3)]

    def ask(i):
        prompt, n, settings, seed = asks[i]
        extra = {"top_k": settings["top_k"]} if "top_k" in settings else None  # vLLM's extension: not in the client
        openai_fields = {k: v for k, v in settings.items() if k != "top_k"}
        return api.completions.create(model="target", prompt=prompt, max_tokens=n, seed=seed, extra_body=extra,
                                      **openai_fields)

    with ThreadPoolExecutor(len(asks)) as pool:
        got = [r.choices[0].text for r in pool.map(ask, range(len(asks)))]
    for (prompt, n, settings, seed), answer in zip(asks, got):
        cfg = SamplingConfig(settings.get("temperature", 0.0), max(settings.get("top_k", 0), 0),
                             settings.get("top_p", 1.0))
        assert answer == text(tokenizer(prompt).input_ids, n, cfg, seed or 0), (prompt, settings, seed)
    assert got[2] != text(tokenizer("hello there").input_ids, 10)  # sampled: not the greedy text


@pytest.mark.slow  # ~37 s; in CI a grammar's greedy speculation equals the engine's constrained target-only
# (test_grammar), and the load benchmark constrains every method through the server (below)
def test_structured_output_matches_and_equals_the_engine_alone(server, alone):
    """response_format (json_schema) and structured_outputs (regex, choice): each answer follows its grammar and is
    the constrained engine's own for the prompt alone, greedy, beside free requests."""
    base, _, _ = server
    text, tokenizer = alone
    api = client(base)
    schema = {"type": "integer"}  # the tiny target's config makes '"' (id 2) a stop token: no JSON strings here
    asks = [("abc", 24, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
             Grammar.json_schema(schema)),
            ("hello", 12, {"structured_outputs": {"regex": "[a-c]{2,5}!"}}, Grammar("regex", "[a-c]{2,5}!")),
            ("x", 6, {"structured_outputs": {"choice": ["yes", "no"]}}, Grammar.choice(["yes", "no"])),
            ("the quick fox", 9, {}, None)]

    def ask(i):
        prompt, n, extra, _ = asks[i]
        return api.completions.create(model="target", prompt=prompt, max_tokens=n, extra_body=extra or None)

    with ThreadPoolExecutor(len(asks)) as pool:
        replies = list(pool.map(ask, range(len(asks))))
    for (prompt, n, _, grammar), reply in zip(asks, replies):
        assert reply.choices[0].text == text(tokenizer(prompt).input_ids, n, grammar=grammar), prompt
    assert isinstance(json.loads(replies[0].choices[0].text), int)
    assert re.fullmatch("[a-c]{2,5}!", replies[1].choices[0].text) and replies[2].choices[0].text in ("yes", "no")


def test_echo_puts_the_prompt_before_the_completion_streamed_or_not(target, server):
    """Completions' `echo`: the text begins with the prompt (token ids: their decoded text), streamed as a first
    chunk."""
    from jaxspec.prompts import load_tokenizer

    base, _, _ = server
    api = client(base)
    plain = api.completions.create(model="target", prompt="abc", max_tokens=6).choices[0].text
    assert api.completions.create(model="target", prompt="abc", max_tokens=6, echo=True).choices[0].text == (
        "abc" + plain)
    chunks = [c.choices[0].text for c in api.completions.create(model="target", prompt="abc", max_tokens=6,
                                                                  echo=True, stream=True)]
    assert chunks[0] == "abc" and "".join(chunks) == "abc" + plain
    ids = load_tokenizer(target[0])("abc").input_ids
    assert api.completions.create(model="target", prompt=ids, max_tokens=6, echo=True).choices[0].text == (
        load_tokenizer(target[0]).decode(ids) + plain)


def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_read_it(target, server):
    """`echo` with `logprobs`: every prompt token (the first with none) with its log-probability under the target
    and its alternatives, then the completion's; `max_tokens: 0` scores the prompt alone (lm-evaluation-harness's
    loglikelihood requests send `echo`, `logprobs: 1`, `max_tokens: 1` and read `token_logprobs[ctxlen:-1]`). The
    very floats `Generator.prompt_logprobs` gives the prompt alone, and within float32 rounding transformers'."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxspec.checkpoints.hf import load_target
    from jaxspec.engine.generation import Generator
    from jaxspec.prompts import load_tokenizer

    base, _, scheduler = server
    path, _ = target
    tokenizer = load_tokenizer(path)
    ids = tokenizer("hello there").input_ids
    want = Generator(load_target(path), batch_size=1).prompt_logprobs(ids, 2)
    api = client(base)
    got = api.completions.create(model="target", prompt="hello there", max_tokens=1, echo=True, logprobs=2).choices[0]
    lp = got.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids] + [got.text[len("hello there"):]]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == [t.logprob for t in want]
    assert [list(d.values()) for d in lp.top_logprobs[1 : len(ids)]] == [[v for _, v in t.top] for t in want]
    assert lp.text_offset == list(range(len(ids) + 1))  # one character a token
    alone = api.completions.create(model="target", prompt="hello there", max_tokens=1, logprobs=2).choices[0]
    assert got.text == "hello there" + alone.text and lp.token_logprobs[-1:] == alone.logprobs.token_logprobs
    scored = scheduler.stats.scored_prompts
    zero = api.completions.create(model="target", prompt=[ids, ids[:4]], max_tokens=0, echo=True, logprobs=1)
    assert [c.text for c in zero.choices] == [tokenizer.decode(ids), tokenizer.decode(ids[:4])]
    assert zero.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    assert zero.choices[1].logprobs.token_logprobs == lp.token_logprobs[:4]
    assert zero.usage.completion_tokens == 0 and {c.finish_reason for c in zero.choices} == {"length"}
    assert scheduler.stats.scored_prompts == scored + 2
    chunks = list(api.completions.create(model="target", prompt="hello there", max_tokens=3, echo=True, logprobs=2,
                                         stream=True))
    assert chunks[0].choices[0].text == "hello there"
    assert chunks[0].choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(ids)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        lsm = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    reference = [lsm[j, ids[j + 1]].item() for j in range(len(ids) - 1)]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1 : len(ids)], reference)) < 1e-4
    status, reply = post(base, "/v1/completions", b'{"prompt": "a", "max_tokens": 0, "echo": true}')
    assert status == 400 and "max_tokens 0 scores the prompt alone" in reply["error"]["message"], reply


def test_a_prompt_too_long_to_score_is_a_400_and_a_failed_scoring_fails_its_request_alone(server, monkeypatch):
    """Scoring holds the logits of every position: past MAX_SCORING_BYTES a prompt is refused before it queues.
    A scoring pass that fails (out of memory, say) fails that request alone; the engine keeps serving."""
    from jaxspec.engine import generation

    base, _, scheduler = server
    monkeypatch.setattr(generation, "MAX_SCORING_BYTES", 2 * 4 * 97 * 16)  # 16 tokens at this vocabulary
    status, reply = post(base, "/v1/completions", json.dumps(
        {"prompt": "x" * 40, "max_tokens": 0, "echo": True, "logprobs": 1}).encode())
    assert status == 400 and "scoring its own logprobs" in reply["error"]["message"], reply
    monkeypatch.undo()

    def fail(prompt, top):
        raise RuntimeError("out of memory while scoring")

    monkeypatch.setattr(scheduler.batcher.generator, "prompt_logprobs", fail)
    status, reply = post(base, "/v1/completions", b'{"prompt": "abc", "max_tokens": 0, "echo": true, "logprobs": 1}')
    assert status == 500 and "out of memory while scoring" in reply["error"]["message"], reply
    monkeypatch.undo()
    assert scheduler.alive
    status, reply = post(base, "/v1/completions", b'{"prompt": "ab", "max_tokens": 2}')
    assert status == 200


def test_several_prompts_and_n_choices_each_equal_the_engine_alone(target, server, alone):
    """A completions request with a list of prompts (text or token ids) and `n` choices per prompt: choice
    i * n + j is prompt i's j-th, each what the engine gives that prompt alone (sampled: with the request's seed
    + j), streamed or not; chat takes `n` too."""
    from collections import defaultdict

    base, _, _ = server
    text, tokenizer = alone
    api = client(base)
    prompts = ["abc", "hello there"]
    greedy = [text(tokenizer(p).input_ids, 8) for p in prompts]
    got = api.completions.create(model="target", prompt=prompts, max_tokens=8)
    assert [c.index for c in got.choices] == [0, 1] and [c.text for c in got.choices] == greedy
    assert got.usage.prompt_tokens == sum(len(p) for p in prompts)
    ids = [tokenizer(p).input_ids for p in prompts]
    assert [c.text for c in api.completions.create(model="target", prompt=ids, max_tokens=8).choices] == greedy
    hot = SamplingConfig(1.3, 0, 0.95)
    got = api.completions.create(model="target", prompt=prompts, n=2, seed=5, temperature=1.3, top_p=0.95,
                                 max_tokens=10)
    want = [text(i, 10, hot, seed) for i in ids for seed in (5, 6)]
    assert [c.text for c in got.choices] == want and want[0] != want[1]
    streamed = defaultdict(str)
    reasons = {}
    for chunk in api.completions.create(model="target", prompt=prompts, n=2, seed=5, temperature=1.3, top_p=0.95,
                                        max_tokens=10, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert [streamed[i] for i in range(4)] == want and all(reasons[i] for i in range(4))
    messages = [{"role": "user", "content": "what is x?"}]
    chat_ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False).input_ids
    chat = api.chat.completions.create(model="target", messages=messages, n=2, seed=3, temperature=1.3, top_p=0.95,
                                       max_tokens=6)
    assert [c.message.content for c in chat.choices] == [text(chat_ids, 6, hot, s) for s in (3, 4)]


def test_a_client_that_leaves_mid_stream_frees_its_slot(server):
    base, _, scheduler = server
    cancelled = scheduler.stats.cancelled
    stream = client(base).completions.create(model="target", prompt="abc", max_tokens=240, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.time() + 60
    while (scheduler.stats.cancelled == cancelled or scheduler.running) and time.time() < deadline:
        time.sleep(0.05)
    assert scheduler.stats.cancelled == cancelled + 1 and scheduler.running == 0
    metrics = urllib.request.urlopen(base + "/metrics", timeout=60).read().decode()
    values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
    assert float(values["jaxspec_requests_cancelled_total"]) == scheduler.stats.cancelled
    assert float(values["jaxspec_generated_tokens_total"]) == scheduler.stats.generated_tokens > 0
    assert float(values["jaxspec_slots_running"]) == 0
    batcher = scheduler.batcher
    by_rows = {k: float(v) for k, v in values.items() if k.startswith("jaxspec_engine_step_chunks_by_rows_total")}
    assert by_rows and sum(by_rows.values()) == sum(batcher.step_rows.values())  # (counted while idle: all ended)
    assert 'jaxspec_engine_step_chunks_by_rows_total{drafting="true",rows="1"}' in by_rows, by_rows


def test_a_client_that_leaves_before_its_first_chunk_is_cancelled(server):
    """A streamed request whose client closes the connection right after sending it (before any chunk could come)
    still leaves its slot or the queue: the response's background task cancels whatever is left of it."""
    import socket

    base, _, scheduler = server
    cancelled = scheduler.stats.cancelled
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "abc", "max_tokens": 240, "stream": True}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.time() + 60
    while (scheduler.stats.cancelled == cancelled or scheduler.running or scheduler.waiting) and time.time() < deadline:
        time.sleep(0.05)
    assert scheduler.stats.cancelled == cancelled + 1 and scheduler.running == 0 and scheduler.waiting == 0


@pytest.mark.parametrize("route, body, message", [
    ("/v1/completions", b"{not json", "not valid JSON"),
    ("/v1/completions", b'{"prompt": "a", "max_tokenz": 3}', "unknown field 'max_tokenz'"),
    ("/v1/completions", json.dumps({"prompt": "a" * 300}).encode(), "exceeds the 256 tokens"),
    ("/v1/completions", b'{"prompt": "a", "temperature": -1}', "temperature must be a finite number >= 0"),
    ("/v1/completions", b'{"prompt": "a", "top_p": 0}', "top-p must be in (0, 1]"),
    ("/v1/completions", b'{"prompt": "a", "n": 0}', "n: Input should be greater than or equal to 1"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 0}', "max_tokens 0 scores the prompt alone"),
    ("/v1/completions", b'{"prompt": [[1, 2], []]}', "the prompt is empty"),
    ("/v1/completions", b'{"prompt": [1, 500]}', "prompt token ids must be in"),
    ("/v1/chat/completions", b'{"messages": []}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a"}], '
                             b'"response_format": {"type": "yaml"}}', "is not one of text, json_object, json_schema"),
    ("/v1/completions", b'{"prompt": "a", "structured_outputs": {"regex": "(a"}}', "cannot be compiled"),
])
def test_bad_requests_get_openai_style_400s_and_the_server_keeps_serving(server, route, body, message):
    base, _, _ = server
    status, reply = post(base, route, body)
    assert status == 400 and message in reply["error"]["message"], reply
    assert reply["error"]["type"] == "invalid_request_error"
    status, reply = post(base, "/v1/completions", b'{"prompt": "ab", "max_tokens": 2}')
    assert status == 200 and reply["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.slow  # the server's default: auto chosen at start-up, per bucket of live rows
def test_auto_chooses_the_served_method_once_at_start_up(target, capsys):
    path, head = target
    args = build_parser().parse_args(["--target", str(path), "--draft", str(head), "--slots", "2",
                                      "--max-model-len", "64", "--no-stored-step-costs"])
    assert args.num_speculative_tokens is None  # filled by the checks: auto for a head
    from jaxspec.cli.args import check_generation_args

    check_generation_args(args, tree_sets_depth=True)
    app, scheduler = build_server(args)
    err = capsys.readouterr().err
    # a random head records no acceptance: its first batch's chain drafts at every bucket of live rows
    assert "auto: chain K=" in err and "at 1-2 rows (2 slots)" in err, err
    assert scheduler.batcher.generator.num_draft >= 1 and scheduler.batcher.running == 0
    assert scheduler.batcher.drafting_rows is None and scheduler.batcher.drafts_at(1)


def test_an_unknown_model_or_route_is_an_openai_style_404(server):
    base, _, _ = server
    status, reply = post(base, "/v1/completions", b'{"model": "gpt-9", "prompt": "a"}')
    assert status == 404 and "'gpt-9' does not exist" in reply["error"]["message"]
    status, reply = post(base, "/v1/nothing", b"{}")
    assert status == 404 and reply["error"]["type"] == "invalid_request_error"



def test_the_load_benchmark_measures_the_server(target, tmp_path, capsys):
    """`python -m jaxspec.bench --serve-load`: the server at each concurrency, every request answered (with a draft it
    also runs target-only: here --no-draft, one server, to keep CI short)."""
    from jaxspec.bench.cli import main as bench

    path, head = target
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n"
                               for i, p in enumerate(["abc", "hello there", "x", "what is x?", "the fox"])))
    assert bench(["--serve-load", str(prompts), "--target", str(path), "--no-draft", "--slots", "4",
                  "--max-model-len", "256", "--concurrency", "1,4", "--max-new-tokens", "6", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["load"]
    assert [(r["method"], r["concurrency"]) for r in rows] == [("target-only", 1), ("target-only", 4)]
    for r in rows:
        assert r["requests"] == 5 and 5 <= r["tokens"] <= 30 and r["requests_per_second"] > 0
        assert 0 < r["time_to_first_token_ms"]["p50"] <= r["time_to_first_token_ms"]["p90"]
        assert 0 <= r["longest_gap_ms"]["p50"] <= r["longest_gap_ms"]["p90"] <= r["longest_gap_ms"]["max"]
        assert r["mean_accepted_length"] is None
    from jaxspec.bench.cli import build_parser, serve_argv

    # with a draft: the speculative server's arguments, the slots from the highest concurrency
    args = build_parser().parse_args(["--serve-load", str(prompts), "--draft", str(head), "--tree", "6,3,2",
                                      "--concurrency", "1,4,16", "--dtype", "bfloat16", "--prefill-chunk", "0,256",
                                      "--step-buckets", "on,off"])
    assert args.prefill_chunk == [0, 256] and args.step_buckets == [True, False]
    common = ["--slots", "16", "--max-model-len", "1024", "--prefill-chunk", "256"]
    flags = ["--dtype", "bfloat16", "--numerics", "invariant", "--kernels", "auto"]
    assert serve_argv(args, True, 256) == [*common, *flags, "--draft", str(head), "--tree", "6,3,2"]
    assert serve_argv(args, False, 256, step_buckets=False) == [*common, "--no-step-buckets", *flags, "--no-draft"]
    # a small draft model, and prompt lookup, are served as the server takes them
    args = build_parser().parse_args(["--serve-load", str(prompts), "--proposer", "draft-model", "--draft-model",
                                      str(path), "--num-speculative-tokens", "2"])
    argv = serve_argv(args, True, 512)
    assert argv[argv.index("--proposer"):] == ["--proposer", "draft-model", "--draft-model", str(path),
                                                "--num-speculative-tokens", "2"]
    args = build_parser().parse_args(["--serve-load", str(prompts), "--proposer", "ngram", "--ngram-max", "4"])
    argv = serve_argv(args, True, 512)
    assert argv[argv.index("--proposer"):][:6] == ["--proposer", "ngram", "--ngram-min", "1", "--ngram-max", "4"]


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_incremental_detokenizing_gives_the_whole_decode(kind):
    """The server's text decoded a window at a time is `decode(ids)` after every update, and what it streams adds up
    to it: random ids (bytes of split characters among them) in random chunks, byte-level BPE and SentencePiece."""
    import random

    from tokenizers import ByteLevelBPETokenizer, SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from jaxspec.serve.app import TextTracker

    corpus = ["Grüße aus Köln, 東京 and Zürich!", "naïve café — 12 × 7 = 84", "emoji 🙂 ok", "the quick brown fox"] * 20
    backend = ByteLevelBPETokenizer() if kind == "byte-level" else SentencePieceBPETokenizer()
    backend.train_from_iterator(corpus, vocab_size=400, min_frequency=1)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 60))]
        tracker, streamed, i = TextTracker(tokenizer, ()), "", 0
        while i < len(ids):
            n = rng.randrange(1, 5)
            streamed += tracker.advance(ids[i : i + n], final=i + n >= len(ids))
            i += n
            assert tracker.text() == tokenizer.decode(ids[:i], skip_special_tokens=True,
                                                      clean_up_tokenization_spaces=False)
        assert streamed == tracker.text()
    # a stop string inside an update: the usage counts the tokens up to the one that completed it, not the rest of
    # the chunk the engine produced with it (all of them were counted)
    ids = tokenizer("zig zag: the brown cafe fox ate 12 quick figs").input_ids
    stop = tokenizer.decode(ids[2:4], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    tracker = TextTracker(tokenizer, (stop,))
    tracker.advance(ids, final=False)
    want = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n], skip_special_tokens=True,
                                                                              clean_up_tokenization_spaces=False))
    assert tracker.stopped and tracker.tokens_used() == want < len(ids)


def test_the_benchmark_constrains_every_method_and_checks_the_answers(target, tmp_path, capsys):
    """`bench --regex`: target-only and the chain under the grammar give the same text, and every answer that ended
    is a whole answer of the grammar."""
    from jaxspec.bench.cli import main as bench

    path, head = target
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "abc"}\n{"id": "b", "prompt": "hello"}\n')
    assert bench(["--target", str(path), "--draft", str(head), "--num-speculative-tokens", "3", "--raw",
                  "--prompts-file", str(prompts), "--max-new-tokens", "12", "--regex", "[a-c]{2,5}!", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (row,) = result["speculative"]
    assert row["identical_outputs"] == "2/2"
    report = result["structured_output"]
    assert report["grammar"] == "regex" and report["ended"] == 2 == report["ended_and_matching"]
