"""Tests for kvcompose.reco (ReCo: reward-coordinated compression, reflection penalty, early stopping)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteriaList,
)

from helpers import examples
from kvcompose.reco import (
    Boundary,
    ConfidenceReward,
    ConfidenceStopping,
    ForcePrefix,
    PRMReward,
    ReflectionPenalty,
    RewardBudgetSchedule,
    RewardTracker,
    RewardTrackingProcessor,
    StepInfo,
    StepReward,
    StepSegmenter,
    reward_to_budget,
    split_steps,
)

HYP = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------------------
# tokenizers
# ------------------------------------------------------------------------------------------------


class CharTok:
    """One token per ASCII char; id = ord(char). Id 0 is padding (decoded to nothing)."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))

    def __call__(self, text, return_tensors=None):
        ids = torch.tensor([self.encode(text)])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class WordTok:
    """A tiny BPE-like tokenizer: words carry their leading space as 'Ġ', newline is 'Ċ'."""

    WORDS = [
        "wait", "Wait", "hmm", "Hmm", "alternatively", "Alternatively", "but", "But", "let", "Let",
        "me", "check", "verify", "double", "Double", "the", "answer", "is", "so", "Step", "x",
    ]  # fmt: skip

    def __init__(self):
        pieces = ["<pad>", "Ċ", "Ġ", "-", ".", ":", "1", "2"]
        for w in self.WORDS:
            pieces += [w, "Ġ" + w]
        self.pieces = pieces
        self.ids = {p: i for i, p in enumerate(pieces)}

    def encode(self, text, add_special_tokens=False):
        out = []
        for unit in re.findall(r" ?[A-Za-z]+|\n| |.", text):
            key = unit.replace(" ", "Ġ").replace("\n", "Ċ")
            if key in self.ids:
                out.append(self.ids[key])
            else:
                out += [self.ids[c.replace(" ", "Ġ")] for c in unit]
        return out

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids if i != 0).replace("Ġ", " ").replace("Ċ", "\n")

    def id(self, piece):
        return self.ids[piece]


@pytest.fixture(scope="module")
def hf_char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={chr(i): i for i in range(128)}, unk_token="\x01"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="\x00", eos_token="\x03")


def tiny_llama_config(**kw):
    return LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, **kw,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# segmentation
# ------------------------------------------------------------------------------------------------


def test_blank_lines_consecutive_and_crlf():
    assert split_steps("a\n\nb\n\n\n\nc") == ["a", "b", "c"]
    assert split_steps("a\r\n\r\nb\n  \n\t\nc\n") == ["a", "b", "c"]
    assert split_steps("\n\n\n\na\n\n") == ["a"]
    assert split_steps("one line\nsecond line") == ["one line\nsecond line"]
    assert split_steps("") == []


def test_step_markers_ten_vs_one_and_markdown():
    text = "Step 1: x = 2\nStep 10: y = 3\n**Step 11.** z\n### Step 12 - w"
    assert split_steps(text) == ["Step 1: x = 2", "Step 10: y = 3", "**Step 11.** z", "### Step 12 - w"]
    # "Step 1" at the very end could still become "Step 10": not a boundary yet
    assert split_steps("Step 9: a\nStep 1", include_partial=False) == []
    assert split_steps("Step 9: a\nStep 10", include_partial=False) == []
    assert split_steps("Step 9: a\nStep 10:", include_partial=False) == ["Step 9: a"]
    # a reference to a step inside a line is not a marker
    assert split_steps("Using Step 1, we get 4.\nStep 2: done") == ["Using Step 1, we get 4.", "Step 2: done"]
    # blank line directly followed by a marker: one boundary, no empty step
    assert split_steps("Step 1: a\n\nStep 2: b\n\n\nStep 3: c") == ["Step 1: a", "Step 2: b", "Step 3: c"]


def test_trailing_partial_step():
    text = "Step 1: a.\n\nStep 2: b\n\nStep 3: half a th"
    assert split_steps(text) == ["Step 1: a.", "Step 2: b", "Step 3: half a th"]
    assert split_steps(text, include_partial=False) == ["Step 1: a.", "Step 2: b"]


def test_sentence_ends_tricky_text():
    text = (
        "The price is $1,000.50 and x = 3.5 today. We use e.g. the rule of Mr. Smith and Dr. Who. "
        'J. Doe agrees! Really? Hmm... not sure. He said "yes." Then (see Fig. 2) we stop.\n'
        "1. first item\n2. second item"
    )
    assert split_steps(text, delimiters=(), sentence_ends=True) == [
        "The price is $1,000.50 and x = 3.5 today.",
        "We use e.g. the rule of Mr. Smith and Dr. Who.",
        "J. Doe agrees!",
        "Really?",
        "Hmm... not sure.",
        'He said "yes."',
        "Then (see Fig. 2) we stop.",
        "1. first item\n2. second item",
    ]
    # off by default
    assert split_steps("A cat. A dog.") == ["A cat. A dog."]
    # a period at the very end is not an end yet (could be the dot of "3.5")
    assert split_steps("x is 3.", delimiters=(), sentence_ends=True, include_partial=False) == []
    assert split_steps("x is 3.5", delimiters=(), sentence_ends=True, include_partial=False) == []
    assert split_steps("x is 3. ", delimiters=(), sentence_ends=True, include_partial=False) == ["x is 3."]


def test_literal_regex_and_boundary_delimiters():
    assert split_steps("a<step>b<step>", delimiters=("<step>",)) == ["a", "b"]
    assert split_steps("a;;b;c", delimiters=(re.compile(r";+"),)) == ["a", "b", "c"]
    marker = Boundary(re.compile(r"^Case \d+(?=\D)", re.M), "marker")
    assert split_steps("intro\nCase 1: x\nCase 2: y", delimiters=(marker,)) == ["intro", "Case 1: x", "Case 2: y"]
    assert split_steps("Paso 1: a\nPaso 2: b", delimiters=("Paso ",)) == ["Paso 1: a", "Paso 2: b"]
    with pytest.raises(ValueError):
        StepSegmenter(delimiters=(), sentence_ends=False)


FRAGMENTS = ["3.5", " e.g. ", "Mr. ", "\n\n", "\n", "Step ", "1", "0", ":", " ", ". ", "!", "...", "x",
             "Wait", "? ", "$1,000.50", "\n \n", "**", "J. ", "1. ", "\r\n", '."', "a"]  # fmt: skip


@HYP
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=30), st.booleans())
def test_streaming_equals_batch_split(frags, sentence_ends):
    """Prefix stability: feeding the text token by token yields exactly the batch split's complete
    steps, in order, each once; the partial step matches the batch's trailing step."""
    text = "".join(frags)
    seg = StepSegmenter(sentence_ends=sentence_ends)
    stream = seg.stream(CharTok())
    got = []
    for c in text:
        got += [s.text for s in stream.push(ord(c))]
    assert got == seg.split(text, include_partial=False)
    p = stream.partial()
    assert got + ([p.text] if p else []) == seg.split(text)


def test_stream_token_spans_wordtok():
    tok = WordTok()
    ids = tok.encode("Step 1: x.\n\nStep 2: so the answer is 2\n\nStep")
    stream = StepSegmenter().stream(tok)
    done = []
    for i, t in enumerate(ids):
        for s in stream.push(t):
            done.append((i, s))
    assert [s.text for _, s in done] == ["Step 1: x.", "Step 2: so the answer is 2"]
    # the first step completes on the second newline token, exactly
    nl = [i for i, t in enumerate(ids) if t == tok.id("Ċ")]
    assert done[0][0] == nl[1] and done[1][0] == nl[3]
    # token spans cover the steps' own tokens; separators go to the next step
    s0, s1 = done[0][1], done[1][1]
    assert tok.decode(ids[s0.tok_lo : s0.tok_hi]) == "Step 1: x."
    assert tok.decode(ids[s1.tok_lo : s1.tok_hi]).strip() == "Step 2: so the answer is 2"
    assert s1.tok_lo == s0.tok_hi


# ------------------------------------------------------------------------------------------------
# rewards
# ------------------------------------------------------------------------------------------------


def test_confidence_reward_extremes_and_bounds():
    v = 128
    r = ConfidenceReward()
    assert r(StepInfo("x", [1, 2], [0.0, 0.0], [0.0, 0.0], vocab_size=v)) == pytest.approx(1.0)
    uniform = StepInfo("x", [1, 2], [-math.log(v)] * 2, [math.log(v)] * 2, vocab_size=v)
    assert r(uniform) == pytest.approx(0.5 / v, abs=1e-6)
    mid = StepInfo("x", [1], [math.log(0.5)], [0.5 * math.log(v)], vocab_size=v)
    assert r(mid) == pytest.approx(0.5 * 0.5 + 0.5 * 0.5)
    assert ConfidenceReward(weight=1.0)(mid) == pytest.approx(0.5)
    assert r(StepInfo("x", [], [], [])) == 0.5  # no statistics -> neutral
    assert r(StepInfo("x", [1], [float("nan")], [float("nan")], vocab_size=v)) == 0.5
    with pytest.raises(ValueError):
        ConfidenceReward(weight=1.5)


@HYP
@given(
    st.lists(st.floats(min_value=-30, max_value=0), min_size=1, max_size=20),
    st.lists(st.floats(min_value=0, max_value=10), min_size=1, max_size=20),
    st.floats(0, 1),
)
def test_confidence_reward_in_unit_interval(lps, ents, w):
    n = min(len(lps), len(ents))
    r = ConfidenceReward(weight=w)(StepInfo("x", list(range(n)), lps[:n], ents[:n], vocab_size=128))
    assert 0.0 <= r <= 1.0


def test_prm_reward_callable_gets_prefix_and_step():
    seen = []

    def fn(prefix, step):
        seen.append((prefix, step))
        return 3.0 if "good" in step else -1.0

    prm = PRMReward(fn)
    assert isinstance(prm, StepReward)
    assert prm(StepInfo("a good step", prefix_text="Q: 1+1?\n")) == 1.0  # clamped
    assert prm(StepInfo("bad", prefix_text="Q")) == 0.0
    assert seen[0] == ("Q: 1+1?\n", "a good step")
    assert PRMReward(lambda p, s: 0.0, transform=lambda x: 1 / (1 + math.exp(-x)))(StepInfo("s")) == 0.5
    with pytest.raises(ValueError):
        PRMReward(lambda p, s: float("nan"))(StepInfo("s"))


def test_prm_reward_from_hf(one_thread):
    torch.manual_seed(0)
    cfg = tiny_llama_config(num_labels=2, id2label={0: "bad", 1: "good"}, label2id={"bad": 0, "good": 1}, pad_token_id=0)
    model = LlamaForSequenceClassification(cfg).eval()
    tok = CharTok()
    prm = PRMReward.from_hf(model, tok, positive_label="good")
    r = prm(StepInfo("Step 2: 4.", prefix_text="Q: 2+2?\n"))
    with torch.no_grad():
        logits = model(**tok("Q: 2+2?\nStep 2: 4.")).logits[0]
    assert r == pytest.approx(torch.softmax(logits, -1)[1].item(), rel=1e-5)
    assert 0.0 <= r <= 1.0
    r0 = PRMReward.from_hf(model, tok, positive_label=0)(StepInfo("Step 2: 4.", prefix_text="Q: 2+2?\n"))
    assert r0 == pytest.approx(1 - r, rel=1e-5)
    # truncation keeps the end of the text
    r_trunc = PRMReward.from_hf(model, tok, positive_label=1, max_length=5)(StepInfo("Step 2: 4.", prefix_text="Q"))
    with torch.no_grad():
        lt = model(**tok("2: 4.")).logits[0]  # the last 5 chars of "QStep 2: 4."
    assert r_trunc == pytest.approx(torch.softmax(lt, -1)[1].item(), rel=1e-5)
    with pytest.raises(ValueError):
        PRMReward.from_hf(model, tok, positive_label="nope")


# ------------------------------------------------------------------------------------------------
# tracker
# ------------------------------------------------------------------------------------------------


def peaked(b, v, targets, logit):
    s = torch.zeros(b, v)
    for row, t in enumerate(targets):
        s[row, t] = logit
    return s


def drive(tracker, prompt, texts, logits, v=128):
    """Feeds texts (one per row, same length) through observe/append like generate() does.
    Returns the final input_ids."""
    ids = torch.tensor(prompt)
    n = len(texts[0])
    for i in range(n):
        targets = [ord(t[i]) for t in texts]
        tracker.observe(ids, peaked(len(texts), v, targets, logits[i] if isinstance(logits, list) else logits))
        ids = torch.cat([ids, torch.tensor(targets)[:, None]], dim=1)
    tracker.sync(ids)
    return ids


def test_tracker_logprobs_entropies_steps_and_rewards():
    tr = RewardTracker(CharTok(), default_reward=0.25)
    assert tr.current_reward == 0.25 and tr.steps == []
    text = "Step 1: a\n\nStep 2: b\n\nStep 3"
    drive(tr, [[81, 58, 10]], [text], 8.0)
    steps = tr.steps
    assert [s.text for s in steps] == ["Step 1: a", "Step 2: b"]
    assert tr.partial_text(0) == "Step 3"
    assert tr.generated_text(0) == text
    # log-prob and entropy of a peaked distribution (one logit 8, others 0), recomputed by hand
    logp = torch.log_softmax(peaked(1, 128, [65], 8.0), -1)[0]
    ent = -(logp.exp() * logp).sum().item()
    s0 = steps[0]
    assert s0.token_ids == [ord(c) for c in "Step 1: a"]
    assert torch.allclose(s0.logprobs, torch.full((9,), logp[65].item()), atol=1e-5)
    assert torch.allclose(s0.entropies, torch.full((9,), ent), atol=1e-4)
    assert s0.vocab_size == 128 and s0.index == 0 and s0.row == 0
    assert s0.prefix_text == "Q:\n" and steps[1].prefix_text == "Q:\nStep 1: a\n\n"
    expected = ConfidenceReward()(s0)
    assert tr.rewards_of(0) == pytest.approx([expected, expected])
    assert tr.current_reward == pytest.approx(expected) and s0.reward == pytest.approx(expected)
    # finalize scores the trailing partial step
    last = tr.finalize()
    assert [s.text for s in last] == ["Step 3"] and len(tr.rewards_of(0)) == 3


def test_tracker_step_completes_exactly_on_separator_token():
    tr = RewardTracker(CharTok())
    ids = torch.tensor([[81]])
    text = "ab\n\ncd"
    counts = []
    for c in text:
        tr.observe(ids, peaked(1, 128, [ord(c)], 5.0))
        ids = torch.cat([ids, torch.tensor([[ord(c)]])], 1)
        tr.sync(ids)  # what ConfidenceStopping does after the append
        counts.append(len(tr.rewards_of(0)))
    assert counts == [0, 0, 0, 1, 1, 1]


def test_tracker_batch_rows_are_independent():
    tr = RewardTracker(CharTok())
    texts = ["x\n\ny\n\nzz", "long step\n\nw"]
    texts = [t.ljust(12, "~") for t in texts]
    conf = [12.0] * 12
    drive(tr, [[81], [82]], texts, conf)
    assert [s.text for s in tr.steps_of(0)] == ["x", "y"]
    assert [s.text for s in tr.steps_of(1)] == ["long step"]
    assert {s.row for s in tr.steps} == {0, 1}
    assert len(tr.current_rewards) == 2 and tr.current_reward == min(tr.current_rewards)
    assert tr.steps_of(0)[1].prefix_text == "Q" + "x\n\n"


def test_tracker_confident_vs_hesitant_rewards_and_observe_idempotent():
    tr = RewardTracker(CharTok())
    ids = torch.tensor([[81], [81]])
    for c in "ab\n\n":
        sharp, flat = peaked(1, 128, [ord(c)], 20.0), peaked(1, 128, [ord(c)], 1.0)
        tr.observe(ids, torch.cat([sharp, flat]))
        tr.observe(ids, torch.zeros(2, 128))  # second observer at the same length: ignored
        ids = torch.cat([ids, torch.tensor([[ord(c)], [ord(c)]])], 1)
    tr.sync(ids)
    hi, lo = tr.reward_of(0), tr.reward_of(1)
    assert hi > 0.99 and lo < 0.2


def test_tracker_resets_on_new_generation():
    tr = RewardTracker(CharTok())
    drive(tr, [[81, 82, 83]], ["a\n\nb\n\n"], 5.0)
    g = tr.generation
    assert len(tr.steps) == 2
    tr.observe(torch.tensor([[81]]), torch.zeros(1, 128))  # shorter input -> new generate() call
    assert tr.steps == [] and tr.generation == g + 1
    drive(tr, [[70, 71]], ["c\n\n"], 5.0)
    assert [s.text for s in tr.steps] == ["c"]


# ------------------------------------------------------------------------------------------------
# budget schedule
# ------------------------------------------------------------------------------------------------


class FakeRewards:
    def __init__(self, rewards):
        self.rewards = list(rewards)

    def reward_of(self, row):
        return self.rewards[row]

    @property
    def current_rewards(self):
        return list(self.rewards)

    @property
    def current_reward(self):
        return min(self.rewards)


@HYP
@given(
    st.integers(1, 4096),
    st.floats(0, 1),
    st.floats(0, 1),
    st.floats(0.01, 1.0),
    st.floats(0.01, 1.0),
    st.integers(1, 64),
    st.floats(0, 1),
    st.floats(0, 1),
)
def test_budget_monotone_and_bounded(base, a, b, s1, s2, min_budget, r1, r2):
    low, high = sorted((a, b))
    min_scale, max_scale = sorted((s1, s2))
    sched = RewardBudgetSchedule(base, low=low, high=high, min_scale=min_scale, max_scale=max_scale, min_budget=min_budget)
    lo_r, hi_r = sorted((r1, r2))
    b_lo, b_hi = sched(lo_r), sched(hi_r)
    assert b_lo >= b_hi  # harder compression (smaller budget) at higher reward
    for x in (b_lo, b_hi):
        assert isinstance(x, int) and min(min_budget, base) <= x <= base


def test_budget_schedule_values():
    s = RewardBudgetSchedule(1000, low=0.2, high=0.8, min_scale=0.5, max_scale=1.0)
    assert s(0.0) == 1000 and s(0.2) == 1000
    assert s(0.5) == 750
    assert s(0.8) == 500 and s(1.0) == 500
    assert s(float("nan")) == 1000
    assert s(1.0, base_budget=64) == 32
    assert RewardBudgetSchedule(10, min_scale=0.01, min_budget=4)(1.0) == 4
    assert s.budget(FakeRewards([0.9])) == 500
    assert s.budget(FakeRewards([0.9, 0.1])) == 1000  # batch: most cautious row
    assert s.budget(FakeRewards([0.9, 0.1]), row=0) == 500
    assert s.budgets(FakeRewards([0.9, 0.5, 0.1])) == [500, 750, 1000]
    assert reward_to_budget(1.0, 100) == 50 and reward_to_budget(0.0, 100) == 100
    assert reward_to_budget(0.5, 100, min_scale=0.2) == 60
    for bad in (dict(base_budget=0), dict(base_budget=8, low=0.9, high=0.1), dict(base_budget=8, min_scale=0.0)):
        with pytest.raises(ValueError):
            RewardBudgetSchedule(**bad)


def test_budget_with_real_tracker():
    tr = RewardTracker(CharTok())
    s = RewardBudgetSchedule(100, low=0.0, high=1.0)
    assert s.budget(tr) == 75  # default reward 0.5 before any step: scale 0.75
    drive(tr, [[81]], ["ab\n\n"], 30.0)
    r = tr.current_reward
    assert r > 0.99 and s.budget(tr) == math.floor(100 * (1 - 0.5 * r) + 1e-9) and s.budget(tr) in (50, 51)


# ------------------------------------------------------------------------------------------------
# reflection penalty
# ------------------------------------------------------------------------------------------------


def test_reflection_token_ids_bpe_like():
    tok = WordTok()
    rp = ReflectionPenalty(tok, FakeRewards([0.9]), update_tracker=False)
    expect = {tok.id(p) for w in ["wait", "Wait", "hmm", "Hmm", "alternatively", "Alternatively"] for p in (w, "Ġ" + w)}
    assert set(rp.token_ids) == expect
    for common in ["Ġlet", "let", "Ġbut", "Ġdouble", "Ġme", "Ġcheck", "Ċ", "Ġ"]:
        assert tok.id(common) not in rp.token_ids
    assert (tok.id("Ġlet"), tok.id("Ġme"), tok.id("Ġcheck")) in rp.phrases
    assert (tok.id("Ġdouble"), tok.id("-"), tok.id("check")) in rp.phrases


def test_reflection_first_token_skips_whitespace_pieces():
    # char-level: " wait" starts with a space token, which must not be penalised
    rp = ReflectionPenalty(CharTok(), FakeRewards([0.9]), words=["wait", "Hmm"], update_tracker=False)
    assert rp.token_ids == sorted([ord("w"), ord("H")])


BANDS = [(0.7, 1.0, 5.0), (0.4, 0.7, 1.0)]


def expected_penalty(r):
    if 0.7 <= r <= 1.0:
        return 5.0
    if 0.4 <= r < 0.7:
        return 1.0
    return 0.0


@HYP
@given(st.lists(st.floats(0, 1), min_size=1, max_size=4), st.integers(0, 2**31 - 1))
def test_penalty_only_in_bands_and_only_on_configured_ids(rewards, seed):
    tok = WordTok()
    v = len(tok.pieces)
    rp = ReflectionPenalty(tok, FakeRewards(rewards), bands=BANDS, update_tracker=False)
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(len(rewards), v, generator=g)
    input_ids = torch.full((len(rewards), 3), tok.id("Ġthe"))  # tail matches no phrase
    out = rp(input_ids, scores.clone())
    diff = scores - out
    ids = torch.tensor(rp.token_ids)
    other = torch.ones(v, dtype=torch.bool)
    other[ids] = False
    assert torch.all(diff[:, other] == 0)
    for row, r in enumerate(rewards):
        assert torch.allclose(diff[row, ids], torch.full((len(ids),), expected_penalty(r)))


def test_penalty_band_edges():
    rp = ReflectionPenalty(WordTok(), FakeRewards([0.5]), bands=BANDS, update_tracker=False)
    assert [rp.band_penalty(r) for r in (0.0, 0.3999, 0.4, 0.6999, 0.7, 0.95, 1.0)] == [0, 0, 1, 1, 5, 5, 5]
    # bands are half-open [low, high): order does not matter at a shared edge
    rev = ReflectionPenalty(WordTok(), FakeRewards([0.5]), bands=BANDS[::-1], update_tracker=False)
    assert [rev.band_penalty(r) for r in (0.3999, 0.4, 0.6999, 0.7, 1.0)] == [0, 1, 1, 5, 5]
    with pytest.raises(ValueError):
        ReflectionPenalty(WordTok(), FakeRewards([0.5]), bands=[(0.8, 0.2, 1.0)])


def test_phrase_continuation_penalty():
    tok = WordTok()
    rp = ReflectionPenalty(tok, FakeRewards([0.9, 0.9, 0.9, 0.1]), bands=BANDS, update_tracker=False)
    v = len(tok.pieces)
    tails = [
        [tok.id("Ġthe"), tok.id("Ġlet"), tok.id("Ġme")],
        [tok.id("Ġthe"), tok.id("Ġthe"), tok.id("Ġlet")],
        [tok.id("Ġthe"), tok.id("Ġthe"), tok.id("Ġbut")],
        [tok.id("Ġthe"), tok.id("Ġlet"), tok.id("Ġme")],  # out of band
    ]
    out = rp(torch.tensor(tails), torch.zeros(4, v))
    assert out[0, tok.id("Ġcheck")] == -5 and out[0, tok.id("Ġverify")] == -5
    assert out[0, tok.id("Ġme")] == 0 and out[0, tok.id("Ġlet")] == 0
    assert out[1, tok.id("Ġme")] == -5 and out[1, tok.id("Ġcheck")] == 0
    assert out[2, tok.id("Ġwait")] == -5  # penalised once, not twice
    assert torch.all(out[3] == 0)


# ------------------------------------------------------------------------------------------------
# stopping
# ------------------------------------------------------------------------------------------------


class ScriptedTracker:
    """Reveals scripted step rewards as the sequence grows: events[row] = [(seq_len, reward), ...]."""

    generation = 1

    def __init__(self, events, answer_at=None):
        self.events = events
        self.answer_at = answer_at or {}
        self.t = 0

    def sync(self, input_ids):
        self.t = input_ids.shape[1]

    def rewards_of(self, row):
        return [r for t, r in self.events[row] if t <= self.t]

    def generated_text(self, row):
        at = self.answer_at.get(row)
        return "so the answer is 7" if at is not None and self.t >= at else "thinking " * (self.t % 5)


def run_criterion(crit, batch, lengths):
    outs = []
    for t in lengths:
        out = crit(torch.zeros(batch, t, dtype=torch.long), None)
        assert out.dtype == torch.bool and out.shape == (batch,)
        outs.append(out.tolist())
    return outs


def test_stopping_fires_exactly_when_last_k_steps_confident():
    tr = ScriptedTracker({0: [(5, 0.9), (7, 0.5), (9, 0.85), (11, 0.95), (13, 0.99)]})
    crit = ConfidenceStopping(tr, k=2, threshold=0.8, answer_pattern=None)
    outs = run_criterion(crit, 1, range(3, 16))
    first = [t for t, o in zip(range(3, 16), outs) if o[0]][0]
    assert first == 11 and crit.fired_at == {0: 11}
    assert all(o == [False] for o in outs[: 11 - 3]) and all(o == [True] for o in outs[11 - 3 :])


def test_stopping_waits_for_answer_pattern():
    tr = ScriptedTracker({0: [(4, 0.9), (5, 0.95)]}, answer_at={0: 9})
    crit = ConfidenceStopping(tr, k=2, threshold=0.8)
    outs = run_criterion(crit, 1, range(3, 12))
    assert [o[0] for o in outs] == [t >= 9 for t in range(3, 12)]


def test_stopping_batch_rows_independent():
    tr = ScriptedTracker({0: [(4, 0.9)], 1: [(6, 0.9)]})
    crit = ConfidenceStopping(tr, k=1, threshold=0.8, answer_pattern=None)
    outs = run_criterion(crit, 2, range(3, 8))
    assert outs == [[False, False], [True, False], [True, False], [True, True], [True, True]]


@HYP
@given(st.lists(st.floats(0, 1), max_size=12), st.integers(1, 4), st.floats(0.1, 0.95))
def test_stopping_matches_bruteforce(rewards, k, thr):
    events = [(3 + 2 * i, r) for i, r in enumerate(rewards)]
    crit = ConfidenceStopping(ScriptedTracker({0: events}), k=k, threshold=thr, answer_pattern=None)
    lengths = list(range(2, 3 + 2 * len(rewards) + 2))
    outs = [o[0] for o in run_criterion(crit, 1, lengths)]
    expected_first = None
    for i in range(k - 1, len(rewards)):
        if all(x >= thr for x in rewards[i - k + 1 : i + 1]):
            expected_first = 3 + 2 * i
            break
    got_first = next((t for t, o in zip(lengths, outs) if o), None)
    assert got_first == expected_first


def test_force_prefix_protocol_by_hand():
    tok = CharTok()
    force = ForcePrefix(tok, prefix=" The answer is", max_answer_tokens=6)
    tr = ScriptedTracker({0: [(4, 0.95)]})
    crit = ConfidenceStopping(tr, k=1, threshold=0.9, answer_pattern=None, force=force)
    ids = torch.tensor([[81, 81, 81]])
    model_text = iter("abcdefghijklmnopqrstuvwxyz")
    answer = iter(" 42\nxyz")
    forced = []
    stopped_at = None
    for _ in range(40):
        scores = torch.zeros(1, 128)
        scores[0, ord(next(model_text))] = 10.0
        scores = force(ids, scores)
        nxt = int(scores.argmax())
        if torch.isinf(scores).sum() == 127:
            forced.append(chr(nxt))
        elif force.is_active(0):
            nxt = ord(next(answer))
        ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        if crit(ids, None)[0]:
            stopped_at = ids.shape[1]
            break
    assert crit.fired_at == {0: 4}
    assert "".join(forced) == " The answer is"
    assert tok.decode(ids[0, 3:].tolist()) == "a The answer is 42\n"
    assert stopped_at == ids.shape[1] == 4 + len(" The answer is") + 4


def test_force_prefix_stops_after_max_answer_tokens():
    tok = CharTok()
    force = ForcePrefix(tok, prefix="A:", max_answer_tokens=3)
    force.trigger(0, 5)
    ids = torch.tensor([[1] * 5 + [ord("A"), ord(":")] + [ord("x")] * 2])
    assert not force.answer_done(0, ids)
    assert force.answer_done(0, torch.cat([ids, torch.tensor([[ord("y")]])], 1))


# ------------------------------------------------------------------------------------------------
# integration with generate()
# ------------------------------------------------------------------------------------------------


class ScriptProcessor(LogitsProcessor):
    """Stands in for the model's distribution: per row, a function of the generated text returning
    {char: logit}; all other chars get logit 0."""

    def __init__(self, prompt_len, fns, tok):
        self.prompt_len, self.fns, self.tok = prompt_len, fns, tok

    def __call__(self, input_ids, scores):
        out = torch.zeros_like(scores)
        for row, fn in enumerate(self.fns):
            text = self.tok.decode(input_ids[row, self.prompt_len :].tolist(), skip_special_tokens=True)
            for ch, logit in fn(text).items():
                out[row, ord(ch)] = logit
        return out


def follow(script, conf=20.0, then=None):
    def fn(text):
        if script.startswith(text) and len(text) < len(script):
            return {script[len(text)]: conf}
        if then is not None:
            return then(text)
        return {"~": conf}

    return fn


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config()).eval()


def generate(model, prompt, procs, crits=(), max_new_tokens=60, **kw):
    ids = torch.tensor(prompt)
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=3,
        logits_processor=LogitsProcessorList(procs),
        stopping_criteria=StoppingCriteriaList(list(crits)),
        **kw,
    )


def test_generate_tracker_sees_model_logits(tiny_llama, hf_char_tokenizer, one_thread):
    """B=2 on the random model's own logits: the tracker's per-token log-probs equal the raw logits'."""
    tr = RewardTracker(hf_char_tokenizer)
    prompt = [[81, 58, 32, 50], [81, 58, 32, 51]]
    out = generate(tiny_llama, prompt, [RewardTrackingProcessor(tr)], max_new_tokens=12, return_dict_in_generate=True, output_logits=True)
    tr.sync(out.sequences)
    seq = out.sequences[:, 4:]
    logits = torch.stack(out.logits, 1)  # [B, n, V]
    want = torch.log_softmax(logits.float(), -1).gather(-1, seq[..., None])[..., 0]
    for row in range(2):
        assert tr._rows[row].logprobs == pytest.approx(want[row].tolist(), abs=1e-5)
        assert tr.generated_text(row) == hf_char_tokenizer.decode(seq[row].tolist(), skip_special_tokens=True)


def test_generate_stops_exactly_when_confident_and_answered(tiny_llama, hf_char_tokenizer, one_thread):
    script = "Step 1: 2+2=4.\n\nStep 2: so 4.\n\nThe answer is 4.\n\nStep 3: more"
    tr = RewardTracker(hf_char_tokenizer)
    stop = ConfidenceStopping(tr, k=2, threshold=0.8, answer_pattern=r"answer is")
    prompt = [[81, 58, 10]]
    out = generate(tiny_llama, prompt, [ScriptProcessor(3, [follow(script)], hf_char_tokenizer), RewardTrackingProcessor(tr)], [stop])
    text = hf_char_tokenizer.decode(out[0, 3:].tolist())
    assert text == "Step 1: 2+2=4.\n\nStep 2: so 4.\n\nThe answer is"
    assert [s.text for s in tr.steps] == ["Step 1: 2+2=4.", "Step 2: so 4."]
    assert all(r > 0.99 for r in tr.rewards_of(0))
    assert stop.fired_at == {0: out.shape[1]}


def test_generate_without_answer_pattern_stops_at_kth_confident_step(tiny_llama, hf_char_tokenizer, one_thread):
    script = "Step 1: a\n\nStep 2: b\n\nStep 3: c\n\n"
    tr = RewardTracker(hf_char_tokenizer)
    stop = ConfidenceStopping(tr, k=2, threshold=0.8, answer_pattern=None)
    out = generate(tiny_llama, [[81]], [ScriptProcessor(1, [follow(script)], hf_char_tokenizer), RewardTrackingProcessor(tr)], [stop])
    # the second step is complete as soon as the separator's second newline is generated
    assert hf_char_tokenizer.decode(out[0, 1:].tolist()) == "Step 1: a\n\nStep 2: b\n\n"


@pytest.mark.parametrize("tracking_processor", [True, False])
def test_generate_reflection_penalty_depends_on_reward(tiny_llama, hf_char_tokenizer, one_thread, tracking_processor):
    """After a confident step the penalty (band 0.7-1.0) flips a 'W'(ait) vs 'S' near-tie to 'S';
    after a hesitant step (reward below every band) 'W' wins. Without a RewardTrackingProcessor the
    penalty processor feeds the tracker itself."""
    tie = {"W": 10.0, "S": 9.5}

    def run(conf):
        tr = RewardTracker(hf_char_tokenizer)
        fn = follow("ok.\n\n", conf=conf, then=lambda text: tie if text == "ok.\n\n" else {"~": 20.0})
        procs = [ScriptProcessor(1, [fn], hf_char_tokenizer)]
        procs += [RewardTrackingProcessor(tr)] if tracking_processor else []
        procs += [ReflectionPenalty(hf_char_tokenizer, tr, bands=BANDS)]
        out = generate(tiny_llama, [[81]], procs, max_new_tokens=7)
        return hf_char_tokenizer.decode(out[0, 1:].tolist()), tr

    text_hi, tr_hi = run(20.0)
    text_lo, tr_lo = run(2.0)
    assert tr_hi.rewards_of(0)[0] > 0.7 and tr_lo.rewards_of(0)[0] < 0.4
    assert text_hi[5] == "S" and text_lo[5] == "W"


def test_generate_force_answer_prefix(tiny_llama, hf_char_tokenizer, one_thread):
    """Force mode: once two confident steps are done, ' The answer is' is forced token by token, the
    model answers, and generation stops right after the answer number and newline."""
    script = "Step 1: a\n\nStep 2: b\n\nStep 3: ccc"

    def after(text):
        if text.endswith("The answer is"):
            return {" ": 20.0}
        if text.endswith("The answer is "):
            return {"4": 20.0}
        if text.endswith("is 4"):
            return {"2": 20.0}
        if text.endswith("is 42"):
            return {"\n": 20.0}
        return {"z": 20.0}

    tr = RewardTracker(hf_char_tokenizer)
    force = ForcePrefix(hf_char_tokenizer, prefix="The answer is")
    stop = ConfidenceStopping(tr, k=2, threshold=0.8, answer_pattern=None, force=force)
    procs = [ScriptProcessor(1, [follow(script, then=after)], hf_char_tokenizer), RewardTrackingProcessor(tr), force]
    out = generate(tiny_llama, [[81]], procs, [stop], max_new_tokens=80)
    assert hf_char_tokenizer.decode(out[0, 1:].tolist()) == "Step 1: a\n\nStep 2: b\n\nThe answer is 42\n"


def test_generate_batch_stops_rows_independently(tiny_llama, hf_char_tokenizer, one_thread):
    script = "Step 1: a\n\nStep 2: b\n\nStep 3: c\n\nStep 4: d\n\n"
    tr = RewardTracker(hf_char_tokenizer)
    stop = ConfidenceStopping(tr, k=2, threshold=0.8, answer_pattern=None)
    fns = [follow(script, conf=20.0), follow(script, conf=2.0)]
    out = generate(tiny_llama, [[81], [82]], [ScriptProcessor(1, fns, hf_char_tokenizer), RewardTrackingProcessor(tr)], [stop], max_new_tokens=30)
    first = "Step 1: a\n\nStep 2: b\n\n"
    assert stop.fired_at.get(0) == 1 + len(first) and 1 not in stop.fired_at
    assert hf_char_tokenizer.decode(out[0, 1:].tolist(), skip_special_tokens=True) == first  # padded after stop
    assert hf_char_tokenizer.decode(out[1, 1:].tolist()) == script[:30]
