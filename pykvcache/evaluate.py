"""Fidelity of KV policies against the full cache on real prose: KL / top-1 while text streams in, needles over
lengths x depths, greedy agreement; JSON, a markdown table and PNG plots (`pykvcache eval`)."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import corpus
from .cache_types import CACHE_TYPES
from ._native import import_llama_cpp
from .checks import MAX_THREADS
from .llama import Llama
from .policies import PolicyError, parse_policy

llama_cpp = import_llama_cpp()

POLICIES = ("sink_recent", "snapkv", "h2o", "pyramid", "entropy")
CITIES = ("Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hobart", "Windhoek", "Reykjavik")
NEEDLE_SETS = ("classic", "varied")

# the varied needle set: (kind of value, the fact, the question that ends where the value starts)
VARIED_TEMPLATES = (
    ("number", "The access code for the {place} archive is {value}.",
     "What is the access code for the {place} archive? The access code for the {place} archive is"),
    ("name", "The keeper of the {place} lighthouse in those years was {value}.",
     "Who was the keeper of the {place} lighthouse? The keeper of the {place} lighthouse was"),
    ("phrase", "Visitors to {place} must give the password \"{value}\" at the gate.",
     "What password must visitors to {place} give at the gate? The password is \""),
    ("number", "According to the survey, the old quarter of {place} had {value} residents.",
     "How many residents did the old quarter of {place} have according to the survey? It had"),
    ("name", "The bridge over the river at {place} was designed by the engineer {value}.",
     "Who designed the bridge over the river at {place}? It was designed by the engineer"),
    ("phrase", "Among sailors, the harbour of {place} is known as the \"{value}\".",
     "What is the harbour of {place} known as among sailors? It is known as the \""),
)
PLACES = ("Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hobart", "Windhoek", "Reykjavik", "Valparaiso", "Tromso",
          "Zanzibar", "Ushuaia")
FIRST_NAMES = ("Amara", "Tomasz", "Ingrid", "Kenji", "Lucia", "Oduya", "Mateo", "Freya", "Anika", "Rashid")
LAST_NAMES = ("Okafor", "Lindqvist", "Marchetti", "Tanaka", "Duarte", "Novak", "Haddad", "Brennan", "Moreau", "Castell")
ADJECTIVES = ("silver", "quiet", "amber", "hollow", "crimson", "gentle", "northern", "patient")
NOUNS = ("harbor", "lantern", "orchard", "compass", "falcon", "meadow", "anchor", "willow")


def varied_value(kind: str, rng: random.Random) -> str:
    """A needle value: a number of 4-7 digits, a first and last name, or a two-word phrase."""
    if kind == "number":
        n_digits = rng.randint(4, 7)
        return str(rng.randint(10 ** (n_digits - 1), 10 ** n_digits - 1))
    if kind == "name":
        return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    return f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"


class EvalError(ValueError):
    """Invalid evaluation settings."""


@dataclass
class EvalConfig:
    """What `pykvcache eval` measures; `quick()` fits a 2-core machine in minutes."""

    policies: List[str] = field(default_factory=lambda: list(POLICIES))
    budgets: List[float] = field(default_factory=lambda: [0.25, 0.1])  # fractions of each prompt
    kl_tokens: int = 4096        # prefix + streamed tokens of the KL text
    stream: int = 256            # tokens streamed (scored) after the prefix
    stream_chunk: int = 16       # tokens per streamed call
    needle_lengths: List[int] = field(default_factory=lambda: [4096])
    depths: List[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    n_agree: int = 64            # greedy tokens compared for agreement (continuing the streamed text)
    threads: int = 2
    seed: int = 1234
    model_path: Optional[str] = None
    text_file: Optional[str] = None  # the user's text for the KL text and the haystacks (default: the corpus)
    corpus: str = "essays"       # the registry corpus when there is no text_file (pykvcache.corpus.CORPORA)
    needles: str = "classic"     # classic: "special magic number" with 4 digits; varied: other wordings; or a JSON file
    prefill: Optional[str] = None  # a prefill stage spec (e.g. "sparse:base=512") added to every policy but the full cache
    type_k: str = "f16"          # KV cache types of every row but the reference, the f16 full cache (-ctk / -ctv); then
    #                              every row runs flash attention, as a quantized V cache needs, the reference too
    type_v: str = "f16"

    @classmethod
    def quick(cls) -> "EvalConfig":
        """A few minutes on 2 cores: 1k-token texts, 3 depths."""
        return cls(kl_tokens=1024, stream=128, needle_lengths=[1024], depths=[0.2, 0.5, 0.8], n_agree=32)

    @classmethod
    def full(cls) -> "EvalConfig":
        """The figures of docs/RESULTS.md: 4k-token texts, 5 depths (about half an hour on 2 cores)."""
        return cls()

    def validate(self) -> None:
        """Raise EvalError naming the first invalid setting."""
        for p in self.policies:
            if p.partition("+")[0].partition(":")[0] not in POLICIES:
                raise EvalError(f"unknown policy '{p}' (known: {', '.join(POLICIES)}, each with its keys, e.g. entropy:topk_share=0.9)")
            keys = [item.partition("=")[0].strip() for part in p.split("+") for item in part.partition(":")[2].split(",")]
            if "budget" in keys or (p.startswith("sink_recent") and "n_recent" in keys):
                raise EvalError(f"policy '{p}' sets its own budget: the budgets are the evaluation's sweep (--budgets)")
            try:
                parse_policy(policy_spec(p, 64))
            except PolicyError as exc:
                raise EvalError(f"policy '{p}': {exc}") from exc
        if not self.policies:
            raise EvalError("no policy to evaluate")
        if not self.budgets:
            raise EvalError("no budget to evaluate (--budgets)")
        if not self.needle_lengths or not self.depths:
            raise EvalError("no needle lengths or no depths: the needle test needs both (--needle-lengths, --depths)")
        for b in self.budgets:
            if not 0.0 < b < 1.0:
                raise EvalError(f"budgets are fractions of the prompt in (0, 1) (got {b})")
        for d in self.depths:
            if not 0.0 <= d <= 1.0:
                raise EvalError(f"depths are in [0, 1] (got {d})")
        if self.stream < 1 or self.stream_chunk < 1 or self.stream >= self.kl_tokens:
            raise EvalError(f"need 1 <= stream < kl_tokens and stream_chunk >= 1 (got stream={self.stream}, "
                            f"kl_tokens={self.kl_tokens}, stream_chunk={self.stream_chunk})")
        if any(n < 128 for n in self.needle_lengths):
            raise EvalError(f"needle lengths must be >= 128 tokens (got {self.needle_lengths})")
        # every policy at every budget in tokens the runs use, so that none fails after others have run
        for n in sorted({self.kl_tokens - self.stream, *self.needle_lengths}):
            for b in self.budgets:
                for p in self.policies:
                    try:
                        parse_policy(policy_spec(p, int(round(b * n))))
                    except PolicyError as exc:
                        raise EvalError(f"policy '{p}' at budget {b} of a {n}-token prompt "
                                        f"({int(round(b * n))} tokens): {exc}") from exc
        if not 1 <= self.threads <= MAX_THREADS:
            raise EvalError(f"-t/--threads must be 1 to {MAX_THREADS} (got {self.threads})")
        for flag, name in (("-ctk", self.type_k), ("-ctv", self.type_v)):
            if name not in CACHE_TYPES:
                raise EvalError(f"{flag} {name}: not a KV cache type (known: {', '.join(CACHE_TYPES)})")
        if self.n_agree < 1:
            raise EvalError(f"n_agree must be >= 1 (got {self.n_agree})")
        if self.corpus not in corpus.CORPORA:
            raise EvalError(f"unknown corpus '{self.corpus}' (known: {', '.join(corpus.CORPORA)})")
        if self.needles not in NEEDLE_SETS:
            if not (self.needles.lower().endswith(".json") or "/" in self.needles or Path(self.needles).is_file()):
                raise EvalError(f"unknown needle set '{self.needles}' (known: {', '.join(NEEDLE_SETS)}, or a JSON file "
                                f"of your own)")
            load_needles(self.needles)  # not found, a folder, a bad entry: one line naming the file
        if self.text_file is not None:
            f = Path(self.text_file)
            if f.is_dir():
                raise EvalError(f"text file {self.text_file} is a folder: give a text file")
            if not f.is_file():
                raise EvalError(f"text file not found: {self.text_file}")
            try:
                f.read_bytes().decode("utf-8-sig")
            except UnicodeDecodeError as exc:
                raise EvalError(f"text file {self.text_file} is not UTF-8 text (byte {exc.start})") from exc
            except OSError as exc:
                raise EvalError(f"text file {self.text_file}: {exc.strerror or exc}") from exc
        if self.prefill is not None:
            try:
                pol = parse_policy(f"none+{self.prefill}")
            except PolicyError as e:
                raise EvalError(f"prefill '{self.prefill}': {e}") from None
            stages = pol.describe()["stages"]
            if "+" in self.prefill or stages["prefill"] is None or any(stages[k] for k in stages if k != "prefill"):
                raise EvalError(f"prefill must be one prefill stage spec, e.g. 'sparse' or 'sparse:base=512' "
                                f"(got '{self.prefill}')")
            for p in self.policies:  # a policy with a prefill stage of its own
                try:
                    parse_policy(policy_spec(p, 64, self.prefill))
                except PolicyError as exc:
                    raise EvalError(f"policy '{p}' with --prefill {self.prefill}: {exc}") from exc

    @property
    def typed(self) -> bool:
        """Whether the rows run on other KV cache types than the reference's f16."""
        return (self.type_k, self.type_v) != ("f16", "f16")

    @property
    def n_ctx(self) -> int:
        """The context of the needle runs (the longest needle prompt and its answer), and of either run at most."""
        return max(self.n_ctx_kl, _ctx_size(max(self.needle_lengths, default=0) + 16))

    @property
    def n_ctx_kl(self) -> int:
        """The context of the KL run (its text and the greedy continuation): the full cache's bytes of the table."""
        return _ctx_size(self.kl_tokens + self.n_agree)


def _ctx_size(n_tokens: int) -> int:
    return (n_tokens + 16 + 255) // 256 * 256


def split_policies(text: str) -> List[str]:
    """The policies of a comma-separated list whose items may carry their own keys (snapkv,entropy:pool=5,topk_share=0.9)."""
    out: List[str] = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        head = x.split("+")[0]  # a key may be followed by more stages: pool=5+window:pool_max=0
        if out and "=" in head and ":" not in head:  # a key of the policy before it
            out[-1] += "," + x
        else:
            out.append(x)
    return out


def policy_spec(name: str, budget: int, prefill: Optional[str] = None) -> Optional[str]:
    """The spec of a policy at `budget` tokens per layer, with an optional prefill stage (None: the full cache)."""
    if name == "full":
        return None
    name, plus, more = name.partition("+")  # more stages may follow: snapkv+window:pool_max=0.5
    name, _, keys = name.partition(":")      # a preset and its own keys: entropy:topk_share=0.9
    keys = f",{keys}" if keys else ""
    if name == "none":
        spec = "none"
    elif name == "sink_recent":
        spec = f"sink_recent:n_sink=4,n_recent={max(budget - 4, 1)}{keys}"
    else:
        spec = f"{name}:budget={budget}{keys}"
    spec += plus + more
    return f"{spec}+{prefill}" if prefill else spec


def eval_texts(cfg: EvalConfig, llm: Llama) -> Tuple[List[int], str]:
    """The KL text's tokens and the needle haystack: essays 0-19 and 20-, or the two parts of the user's file."""
    if cfg.text_file is None and cfg.corpus == "essays":
        texts = corpus.essays()
        tokens = llm.tokenize("\n\n".join(texts[:20]).encode())[: cfg.kl_tokens]
        hay = "\n\n".join(texts[20:])
        what = "the KL text (essays 0-19)"
    elif cfg.text_file is None:
        # the first texts that give kl_tokens tokens are the KL text, the others the haystack
        texts = corpus.texts(cfg.corpus)
        n_chars, k = 0, 0
        while k < len(texts) and n_chars < 8 * cfg.kl_tokens:  # ~4 characters per token, twice over
            n_chars += len(texts[k])
            k += 1
        tokens = llm.tokenize("\n\n".join(texts[:k]).encode())[: cfg.kl_tokens]
        hay = "\n\n".join(texts[k:])
        what = f"the KL text ({cfg.corpus} 0-{k - 1})"
    else:
        text = Path(cfg.text_file).read_bytes().decode("utf-8-sig")  # checked by validate(); line ends as they are
        longest = max(cfg.needle_lengths, default=0)
        # only the first kl_tokens + longest tokens are used: a long file is cut far past them (at a space) before it
        # is tokenized (an audit waited 149 s for an 8.4 MB file); the tokens before the cut are the same
        limit = 16*(cfg.kl_tokens + longest) + 4096
        what = f"{cfg.text_file}"
        if len(text) > limit:
            cut = text.rfind(" ", limit // 2, limit)
            text = text[: cut if cut > 0 else limit]
            what += f" (its first {len(text)} characters)"
        every = llm.tokenize(text.encode())
        tokens = every[: cfg.kl_tokens]
        hay = llm.detokenize(every[cfg.kl_tokens:]).decode("utf-8", errors="replace")
        # the haystack as needle_cases reads it (whitespace collapsed: a source file's indentation is gone)
        n_hay = len(haystack_tokens(llm, hay)) if len(every) > cfg.kl_tokens else 0
        if len(every) < cfg.kl_tokens or n_hay < longest:
            raise EvalError(f"{what} has {len(every)} tokens: the KL text takes the first {cfg.kl_tokens} (kl_tokens) "
                            f"and the needle haystack the rest, which needs {longest} tokens with whitespace collapsed "
                            f"(the longest needle prompt) and has {n_hay}: a longer text, or lower --kl-tokens / "
                            f"--needle-lengths")
    if len(tokens) < cfg.kl_tokens:
        raise EvalError(f"{what} has only {len(tokens)} tokens (kl_tokens is {cfg.kl_tokens})")
    return tokens, hay


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


class Runner:
    """One context for one policy; teacher-forced logits and greedy decoding on llama-cpp-python's objects."""

    def __init__(self, spec: Optional[str], cfg: EvalConfig, reference: bool = False,
                 n_ctx: Optional[int] = None) -> None:
        kwargs: Dict[str, Any] = {}
        if cfg.model_path:
            kwargs["model_path"] = cfg.model_path
        if cfg.prefill or cfg.typed:
            # the reference runs the attention the rows run: the one a prefill mode replaces, the one a quantized cache
            # needs (llama.cpp's flash attention), so that a row's difference is its policy and its cache types alone
            kwargs["flash_attn"] = True
        if not reference and cfg.typed:
            kwargs.update(type_k=CACHE_TYPES[cfg.type_k], type_v=CACHE_TYPES[cfg.type_v])
        self.llm = Llama(n_ctx=n_ctx or cfg.n_ctx, kv_policy=spec, n_batch=512, n_ubatch=512, n_threads=cfg.threads,
                         n_threads_batch=cfg.threads, verbose=False, **kwargs)
        self.n_vocab = self.llm.n_vocab()
        self.flash_attn = self.llm.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED

    def reset(self) -> None:
        self.llm.reset()
        self.llm._ctx.kv_cache_seq_rm(-1, 0, -1)

    def prefill(self, tokens: Sequence[int]) -> None:
        self.llm.eval(list(tokens))

    def logits_chunk(self, tokens: Sequence[int]) -> np.ndarray:
        """Decode tokens in one call and return the logits of each [n, n_vocab]."""
        llm = self.llm
        n_past = llm.n_tokens
        llm._batch.set_batch(batch=list(tokens), n_past=n_past, logits_all=True)
        llm._ctx.decode(llm._batch)
        llm.input_ids[n_past:n_past + len(tokens)] = tokens
        llm.n_tokens += len(tokens)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(len(tokens), self.n_vocab)).copy()

    def last_logits(self) -> np.ndarray:
        """Logits of the last token decoded (the last row after a chunk with every token's logits)."""
        return np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.n_vocab,)).copy()

    def greedy(self, n: int, bytes_trace: Optional[List[int]] = None) -> List[int]:
        out = []
        for _ in range(n):
            tok = int(np.argmax(self.last_logits()))
            out.append(tok)
            self.llm.eval([tok])
            if bytes_trace is not None:
                bytes_trace.append(self.llm.kv_memory().bytes)
        return out

    def close(self) -> None:
        self.llm.close()


def stream_logprobs(r: Runner, tokens: List[int], n_stream: int, chunk: int,
                    on_chunk: Optional[Callable[[int], None]] = None) -> List[np.ndarray]:
    """Log-probs of the last n_stream tokens, streamed in chunks after a prefill of the others.

    Prefill all but the last n_stream tokens, then stream those in chunks (on_chunk(i) is called after the i-th
    chunk)."""
    r.reset()
    r.prefill(tokens[: len(tokens) - n_stream])
    res = []
    for i, t in enumerate(range(len(tokens) - n_stream, len(tokens), chunk)):
        res.append(log_softmax(r.logits_chunk(tokens[t:t + chunk])).astype(np.float32))
        if on_chunk is not None:
            on_chunk(i)
    return res


def compare_logprobs(ref: List[np.ndarray], got: List[np.ndarray]) -> Dict[str, float]:
    """KL(ref || got) per token (mean, p95) and top-1 agreement."""
    kls, agree = [], []
    for a, b in zip(ref, got):
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        kls.append((np.exp(a64) * (a64 - b64)).sum(axis=-1))
        agree.append(a.argmax(axis=-1) == b.argmax(axis=-1))
    kl, ag = np.concatenate(kls), np.concatenate(agree)
    return {"kl_mean": float(max(kl.mean(), 0.0)), "kl_p95": float(max(np.percentile(kl, 95), 0.0)),
            "top1": float(ag.mean()), "n_scored": int(kl.size)}


def load_needles(path: str) -> List[Tuple[str, str, str]]:
    """The needles of a JSON file: a list of {"fact", "question", "answer"} (the question ends where the answer starts;
    the fact holds the answer), or an EvalError that names the file and what is wrong."""
    try:
        entries = json.loads(Path(path).read_bytes().decode("utf-8-sig"))
    except OSError as exc:
        raise EvalError(f"needle file {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise EvalError(f"needle file {path} is not UTF-8 JSON: {exc}") from None
    if not isinstance(entries, list) or not entries:
        raise EvalError(f"needle file {path}: give a JSON list of {{\"fact\", \"question\", \"answer\"}} objects")
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not all(isinstance(e.get(k), str) and e[k].strip() for k in ("fact", "question", "answer")):
            raise EvalError(f"needle file {path}: entry {i} needs non-empty strings \"fact\", \"question\" and \"answer\"")
        try:
            "".join(e[k] for k in ("fact", "question", "answer")).encode("utf-8")
        except UnicodeEncodeError:
            raise EvalError(f"needle file {path}: entry {i} holds a character that is not UTF-8 (a lone surrogate)") from None
        if not answer_in(e["answer"], e["fact"]):
            raise EvalError(f"needle file {path}: entry {i}'s fact does not hold its answer {e['answer']!r}")
        out.append((" " + e["fact"].strip(), "\n\n" + e["question"].strip(), e["answer"].strip()))
    return out


def needle_text(kind: str, i: int, n_tokens: int, rng: random.Random) -> Tuple[str, str, str]:
    """The fact, the question and the answer of needle i of a prompt of n_tokens tokens in a needle set (or a needle
    file's: its entries in turn)."""
    if kind not in NEEDLE_SETS:
        entries = load_needles(kind)
        return entries[(i + n_tokens // 512) % len(entries)]
    if kind == "classic":
        city = CITIES[(i + n_tokens // 7) % len(CITIES)]
        num = rng.randint(1000, 9999)
        return (f" The special magic number for {city} is {num}.",
                f"\n\nWhat is the special magic number for {city}? The special magic number for {city} is", str(num))
    value_kind, fact, question = VARIED_TEMPLATES[(i + n_tokens // 512) % len(VARIED_TEMPLATES)]
    place = PLACES[rng.randrange(len(PLACES))]
    value = varied_value(value_kind, rng)
    return " " + fact.format(place=place, value=value), "\n\n" + question.format(place=place), value


SENTENCE_ENDS = ("!", "?", ";", "\n", "\u3002", "\uff01", "\uff1f", "\uff1b")  # after ".": CJK full-width ones too


def needle_at(llm: Llama, body: Sequence[int], depth: float) -> int:
    """Where a needle goes in a haystack of tokens: after the first full stop at or past `depth`, else the first other
    sentence end, within 5% of the haystack (64 tokens at least); where there is none, before the next word, else at
    `depth` itself (a text without such punctuation put every needle just before the question)."""
    k0 = int(depth * len(body))
    if k0 == 0:
        return 0
    reach = min(len(body), k0 + max(64, len(body) // 20))
    piece = {j: llm.detokenize([body[j]]) for j in range(max(k0 - 2, 0), min(reach + 1, len(body)))}
    for k in range(k0, reach):  # k: the needle goes before body[k], after body[k - 1]
        p = piece[k - 1]
        before = p[-2:-1] or piece.get(k - 2, b"")[-1:]
        if p.endswith(b".") and not (before.isdigit() and piece.get(k, b"")[:1].isdigit()):  # not "3.|14"
            return k
    for k in range(k0, reach):
        if piece[k - 1].decode("utf-8", errors="ignore").rstrip(" ").endswith(SENTENCE_ENDS):
            return k
    for k in range(k0, reach):  # no sentence end: before the next word, not inside one
        if piece.get(k, b" ")[:1].isspace():
            return k
    return k0


def haystack_tokens(llm: Llama, haystack: str) -> List[int]:
    """The tokens of a needle haystack, whitespace collapsed (a source file's indentation is gone)."""
    return llm.tokenize(" ".join(haystack.split()).encode(), add_bos=False)


def needle_cases(llm: Llama, haystack: str, n_tokens: int, depths: Sequence[float], seed: int,
                 kind: str = "classic") -> List[Dict[str, Any]]:
    """Prompts of n_tokens tokens with a fact at each depth (after a sentence end), and their answers."""
    rng = random.Random(seed + n_tokens)
    hay = haystack_tokens(llm, haystack)
    cases = []
    for i, depth in enumerate(depths):
        fact, ask, answer = needle_text(kind, i, n_tokens, rng)
        needle = llm.tokenize(fact.encode(), add_bos=False)
        question = llm.tokenize(ask.encode(), add_bos=False)
        n_body = n_tokens - 1 - len(needle) - len(question)
        if n_body < 1:
            raise EvalError(f"a {n_tokens}-token needle prompt is shorter than its fact and question "
                            f"({len(needle) + len(question) + 1} tokens with the BOS)")
        if len(hay) < n_body:
            raise EvalError(f"the needle haystack has {len(hay)} tokens, too few for a {n_tokens}-token needle prompt")
        body = hay[:n_body]
        k = needle_at(llm, body, depth)
        tokens = [llm.token_bos()] + body[:k] + needle + body[k:] + question
        n_answer = 6 if kind == "classic" else len(llm.tokenize((" " + answer).encode(), add_bos=False)) + 3
        cases.append({"length": n_tokens, "depth": depth, "answer": answer, "tokens": tokens, "n_answer": n_answer})
    return cases


def _joins(c: str) -> bool:
    # a character that continues a word or number (letters and digits of scripts written with spaces; CJK and
    # full-width characters end one, as those texts have no spaces)
    return c.isalnum() and not ("\u3000" <= c <= "\u9fff" or "\uac00" <= c <= "\ud7af" or "\uf900" <= c <= "\uffef")


def answer_in(answer: str, text: str) -> bool:
    """Whether `text` holds the needle's answer as a whole word or number, in any case (" 20781", "2078.5" and
    "Ivanov" do not answer 2078 or Ivan; "Gentle Lantern" answers "gentle lantern", "1311号" 1311)."""
    a, t = answer.casefold(), text.casefold()
    i = t.find(a)
    while i >= 0 and a:
        before, after = t[max(i - 2, 0) : i], t[i + len(a) : i + len(a) + 2]
        open_start = not (_joins(a[0]) and before and (_joins(before[-1]) or (
            len(before) == 2 and before[-1] in ".,:" and before[0].isdigit() and a[0].isdigit())))
        open_end = not (_joins(a[-1]) and after and (_joins(after[0]) or (
            len(after) == 2 and after[0] in ".,:" and after[1].isdigit() and a[-1].isdigit())))
        if open_start and open_end:
            return True
        i = t.find(a, i + 1)
    return False


def needle_hits(r: Runner, cases: List[Dict[str, Any]]) -> List[bool]:
    """Whether the greedy answer of each case holds its value (answer_in)."""
    hits = []
    for c in cases:
        r.reset()
        r.prefill(c["tokens"])
        out = r.llm.detokenize(r.greedy(c["n_answer"])).decode("utf-8", errors="replace")
        hits.append(answer_in(c["answer"], out))
    return hits


def agreement(ref: List[int], got: List[int]) -> int:
    """Greedy tokens equal to the reference before the first divergence."""
    n = 0
    for a, b in zip(ref, got):
        if a != b:
            break
        n += 1
    return n


class Progress:
    """One line per step on stderr, with elapsed time."""

    def __init__(self, total: int, quiet: bool = False) -> None:
        self.total, self.i, self.t0, self.quiet = total, 0, time.perf_counter(), quiet

    def step(self, msg: str) -> None:
        self.i += 1
        if not self.quiet:
            print(f"[{self.i}/{self.total} {time.perf_counter() - self.t0:6.0f}s] {msg}", file=sys.stderr, flush=True)


def evaluate(cfg: EvalConfig, quiet: bool = False) -> Dict[str, Any]:
    """Run every policy at every budget against the full cache; returns the results (JSON-ready)."""
    cfg.validate()
    prog = Progress(1 + cfg.typed + (cfg.prefill is not None) + len(cfg.policies) * len(cfg.budgets), quiet)

    # the texts first, with a small context: a text too short for the settings fails before n_ctx is allocated
    small = Llama(n_ctx=256, verbose=False, **({"model_path": cfg.model_path} if cfg.model_path else {}))
    try:
        tokens, hay_text = eval_texts(cfg, small)
        cases = [c for n in cfg.needle_lengths
                 for c in needle_cases(small, hay_text, n, cfg.depths, cfg.seed, cfg.needles)]
    finally:
        small.close()
    # the full cache of the KL run (its bytes are every row's "x full"), then of the needle prompts
    full = Runner(None, cfg, reference=True, n_ctx=cfg.n_ctx_kl)
    ref_lp = stream_logprobs(full, tokens, cfg.stream, cfg.stream_chunk)
    first_greedy = full.greedy(cfg.n_agree)
    full_self = compare_logprobs(ref_lp, stream_logprobs(full, tokens, cfg.stream, cfg.stream_chunk))
    full_bytes: List[int] = []
    ref_greedy = full.greedy(cfg.n_agree, full_bytes)
    full_self["agree"] = agreement(first_greedy, ref_greedy)  # the reference against itself, as its KL
    full_mem, full_fa = full.llm.kv_memory(), full.flash_attn
    full.close()
    full = Runner(None, cfg, reference=True)
    full_hits = needle_hits(full, cases)
    full.close()
    base = {"policy": "full", "budget_frac": None, **full_self, "needle_hits": full_hits,
            "needle_acc": float(np.mean(full_hits)), "bytes": full_mem.bytes, "bytes_peak": full_mem.bytes_peak,
            "bytes_trace": full_bytes, "n_ctx": cfg.n_ctx_kl, "flash_attn": full_fa}
    prog.step(f"full: self-KL {full_self['kl_mean']:.2g}, needles {sum(full_hits)}/{len(full_hits)}")

    def run_policy(name: str, frac: Optional[float]) -> Dict[str, Any]:
        row: Dict[str, Any] = {"policy": name, "budget_frac": frac}
        r = Runner(policy_spec(name, int(round((frac or 1.0) * (cfg.kl_tokens - cfg.stream))), cfg.prefill), cfg,
                   n_ctx=cfg.n_ctx_kl)
        row["spec"] = r.llm.kv_policy.spec() if r.llm.kv_policy is not None else "full"
        row["flash_attn"] = r.flash_attn
        row.update(compare_logprobs(ref_lp, stream_logprobs(r, tokens, cfg.stream, cfg.stream_chunk)))
        row["budgets"] = r.llm.kv_memory().budgets
        trace: List[int] = []
        row["agree"] = agreement(ref_greedy, r.greedy(cfg.n_agree, trace))
        row["bytes_trace"] = trace
        mem = r.llm.kv_memory()
        row["bytes"], row["bytes_peak"] = mem.bytes, mem.bytes_peak
        row["host_bytes_peak"] = mem.host_bytes_peak  # summarise's pending bins or the host tier, beside the cache
        if cfg.prefill:
            row["density"] = r.llm.kv_sparse().total_density if r.llm.kv_policy.sparse else None
            if name == "none" and row["density"] is not None and row["density"] >= 1.0 and not quiet:
                print(f"eval: --prefill {cfg.prefill} computed every key block of the KL text ({cfg.kl_tokens} "
                      f"tokens): its prompts are below the stage's threshold; see --kl-tokens", file=sys.stderr)
        r.close()
        hits: List[bool] = []
        for n in cfg.needle_lengths:
            rn = Runner(policy_spec(name, int(round((frac or 1.0) * n)), cfg.prefill), cfg)
            hits += needle_hits(rn, [c for c in cases if c["length"] == n])
            rn.close()
        row["needle_hits"], row["needle_acc"] = hits, float(np.mean(hits))
        at = "" if frac is None else f" @ {frac:g}"
        prog.step(f"{row['spec']}{at}: KL {row['kl_mean']:.4f}, top-1 {row['top1']:.3f}, "
                  f"agree {row['agree']}/{cfg.n_agree}, needles {sum(hits)}/{len(hits)}")
        return row

    runs = [base]
    if cfg.typed:
        runs.append(run_policy("full", None))  # the full cache on those types: what quantization alone costs
    if cfg.prefill:
        runs.append(run_policy("none", None))  # the full cache with the prefill mode alone
    for frac in cfg.budgets:
        for name in cfg.policies:
            runs.append(run_policy(name, frac))
    cfg_d = asdict(cfg)
    source = cfg.text_file if cfg.text_file else corpus.describe(cfg.corpus)
    return {"config": cfg_d, "n_ctx": cfg.n_ctx, "source": source,
            "cases": [{k: c[k] for k in ("length", "depth", "answer")} for c in cases], "runs": runs}


def markdown(results: Dict[str, Any]) -> str:
    """The results as a markdown table (full cache first, its own needle accuracy beside each policy's)."""
    full = results["runs"][0]
    n_agree = results["config"]["n_agree"]
    cfg = results["config"]
    default = not cfg.get("text_file") and cfg.get("corpus", "essays") == "essays" and cfg.get("needles", "classic") == "classic"
    lines = [] if default else [f"text: {results.get('source')}; needles: {cfg.get('needles', 'classic')}", ""]
    prefill = cfg.get("prefill")
    if prefill:
        lines += [f"prefill mode of every row but full: {prefill}", ""]
    types = (cfg.get("type_k", "f16"), cfg.get("type_v", "f16"))
    if types != ("f16", "f16"):
        fa = ", all rows with flash attention" if "n_ctx" in full else ""  # since 2026-11-27 (the reference too)
        lines += [f"KV cache types of every row but the first (the reference, f16): K {types[0]}, V {types[1]}; "
                  f"KV bytes against the f16 full cache{fa}", ""]
    # host memory beside the cache (summarise's pending bins, the host tier's tokens), where a row has any
    host = any(row.get("host_bytes_peak", 0) > 0 for row in results["runs"])
    lines += ["| policy | budget | KL mean (nats) | KL p95 | top-1 | greedy agreement | needles | full-cache needles |"
              " KV bytes, peak (x full) |" + (" host bytes, peak (x full KV) |" if host else "")
              + (" key blocks computed |" if prefill else ""),
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if host else "") + ("---:|" if prefill else "")]
    for i, row in enumerate(results["runs"]):
        hits = row["needle_hits"]
        budget = "-" if row["budget_frac"] is None else f"{row['budget_frac']:.0%}"
        label = f"none+{prefill}" if prefill and i > 0 and row["policy"] == "none" else row["policy"]
        label = label if i == 0 or types == ("f16", "f16") else f"{label} [{types[0]}/{types[1]}]"
        density = row.get("density")
        lines.append(f"| {label} | {budget} | {row['kl_mean']:.4f} | {row['kl_p95']:.4f} | {row['top1']:.3f} "
                     f"| {row['agree']}/{n_agree} | {sum(hits)}/{len(hits)} | "
                     f"{sum(full['needle_hits'])}/{len(full['needle_hits'])} | "
                     f"{x_full_bytes(results, row):.3f} |"
                     + (f" {row.get('host_bytes_peak', 0) / full['bytes']:.3f} |" if host else "")
                     + ("" if not prefill else " - |" if density is None else f" {density:.2f} |"))
    return "\n".join(lines)


def x_full_bytes(results: Dict[str, Any], row: Dict[str, Any]) -> float:
    """A row's KV bytes at peak against the full cache of the KL run (its text and greedy continuation)."""
    full = results["runs"][0]
    peak = row.get("bytes_peak", row["bytes"])
    if "n_ctx" in full or row is full or row.get("spec", "full") == "full" or row["policy"] == "none":
        return peak / full["bytes"]
    # results of before 2026-11-27 ran every row in the needle runs' context, results["n_ctx"] cells, so their full
    # caches (above) compare among themselves; a full cache's buffers are n_ctx cells of fixed bytes, so the KL run's
    # context would have held this share of them
    cfg = results["config"]
    return peak / (full["bytes"] * _ctx_size(cfg["kl_tokens"] + cfg["n_agree"]) / results["n_ctx"])


def plot(results: Dict[str, Any], out_dir: Path) -> List[Path]:
    """PNG plots: fidelity vs budget per policy, per-layer budgets, KV bytes over a generation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [r for r in results["runs"] if r["budget_frac"] is not None]
    full = results["runs"][0]
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    paths = []

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for p in policies:
        rows = sorted((r for r in runs if r["policy"] == p), key=lambda r: r["budget_frac"])
        x = [100 * r["budget_frac"] for r in rows]
        axes[0].plot(x, [r["kl_mean"] for r in rows], marker="o", label=p)
        axes[1].plot(x, [r["top1"] for r in rows], marker="o", label=p)
        axes[2].plot(x, [r["needle_acc"] for r in rows], marker="o", label=p)
    axes[2].axhline(full["needle_acc"], color="k", ls="--", lw=1, label="full")
    for ax, title in zip(axes, ("KL mean vs full (nats)", "top-1 agreement", "needle accuracy")):
        ax.set_xlabel("budget (% of prompt)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "fidelity_vs_budget.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    frac = min(r["budget_frac"] for r in runs)
    for r in runs:
        if r["budget_frac"] == frac and r.get("budgets"):
            ax.plot(r["budgets"], marker=".", label=r["policy"])
    paths.append(_finish(plt, fig, ax, "layer", "tokens kept", f"per-layer budgets at {frac:.0%} of the prompt",
                         out_dir / "layer_budgets.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(np.array(full["bytes_trace"]) / 2**20, label="full", color="k")
    for r in runs:
        if r["budget_frac"] == frac:
            ax.plot(np.array(r["bytes_trace"]) / 2**20, label=r["policy"])
    ax.set_ylim(bottom=0)
    paths.append(_finish(plt, fig, ax, "generated token", "KV MiB (ggml buffers)",
                         f"KV bytes over a generation, budget {frac:.0%}", out_dir / "kv_bytes_generation.png"))
    return paths


def _finish(plt: Any, fig: Any, ax: Any, xlabel: str, ylabel: str, title: str, path: Path) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_outputs(results: Dict[str, Any], out_dir: Path) -> List[Path]:
    """eval.json, eval.md and the plots in out_dir: all of them, or none where the writing is interrupted."""
    out_dir = Path(out_dir)
    # made beside them first (in out_dir where it exists, so its parent need not be writable), moved when all are done
    tmp = Path(tempfile.mkdtemp(prefix=".eval-", dir=out_dir if out_dir.is_dir() else out_dir.absolute().parent))
    try:
        (tmp / "eval.json").write_text(json.dumps(results, indent=1))
        (tmp / "eval.md").write_text(markdown(results) + "\n")
        names = ["eval.json", "eval.md"] + [p.name for p in plot(results, tmp)]
        out_dir.mkdir(exist_ok=True)
        for name in names:
            os.replace(tmp / name, out_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out_dir / name for name in names]
