"""The device's side of HAT's speculative decoding (Sec. 3.4) and parallel drafting (Sec. 3.5).

One round, for the last emitted token x at position L (not yet in any cache):

1. **Draft** with w_S = H_L o Lambda o w_L^m: x, d_1, d_2, ... each go through the device's m layers
   and the adapter; stop after the first draft token whose softmax probability is below eta (Eq. 5)
   or after ``limit`` tokens. d_k's shallow state is computed too, so the shallow states of
   [x, d_1..d_k] (k + 1 positions) are ready for verification; no draft token is recomputed.
2. **Verify**: the server runs its middle layers on those shallow states in one step, and the LM head
   turns the deep states into the LLM's own next tokens p_0..p_k. Greedy acceptance: the longest
   prefix with d_j = p_(j-1); a of k accepted, the round emits d_1..d_a and p_a (p_a is the
   correction, or the bonus token when a = k), so output is exactly the LLM's greedy output.
3. **Roll back**: the device's layer caches keep positions up to L + a (x and the accepted drafts),
   the adapter's likewise; the server truncates its caches to the next round's start position.

Parallel drafting: while the server verifies, the device drafts lambda_i steps (Eq. 6, chosen by the
caller) from each of the top-k alternatives to d_k, in branches that share the caches' prefix. When
exactly d_k is rejected and its correction is one of them, the next round starts from that branch's
draft, already computed.

Acceptance length is reported the vLLM way: 1 + accepted / rounds (the bonus token counted).
"""

from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from nodes.contracts.speculative_metrics import acceptance_length as contract_acceptance_length

from .draft import DraftAdapter
from .kv_cache import BranchCache, KVCache
from .model import ModelPart, Segment


class SequenceState:
    """One request's caches on the device: the m layers', the adapter's, and the shallow states that
    are committed but not yet through the adapter."""

    def __init__(self, part: ModelPart, adapter: DraftAdapter, capacity: int) -> None:
        self.shallow_cache: KVCache = part.new_cache(capacity)
        self.adapter_cache: KVCache = adapter.new_cache(capacity)
        self.unabsorbed: List[torch.Tensor] = []

    @property
    def length(self) -> int:
        return self.shallow_cache.length


class Draft(NamedTuple):
    """A round's draft: tokens d_1..d_k, their probabilities, the shallow states of [x, d_1..d_k],
    and the distribution d_k was drawn from (for parallel drafting's candidates)."""

    start: int  # position of x
    tokens: List[int]
    probs: List[float]
    shallow: torch.Tensor  # [k + 1, hidden]
    last_probs: Optional[torch.Tensor]  # [vocab], the step that produced d_k
    reused: bool = False  # started from a parallel draft


class Branch(NamedTuple):
    """A parallel draft from candidate ``token`` (at the position of d_k)."""

    token: int
    tokens: List[int]
    probs: List[float]
    shallow: List[torch.Tensor]  # shallow states of [token, t_1..t_(steps-1)], each [1, hidden]
    dists: List[torch.Tensor]
    shallow_cache: BranchCache
    adapter_cache: BranchCache


class Verdict(NamedTuple):
    accepted: int  # a: draft tokens accepted
    emitted: List[int]  # d_1..d_a, then the LLM's next token
    reused_branch: Optional[Branch]  # the parallel draft the next round starts from


class Verifier:
    """Where verification happens: ``submit`` the shallow states of positions start.., ``replied`` says
    whether the deep states are back (parallel drafting stops then), ``result`` waits for them."""

    def submit(self, shallow: torch.Tensor, start: int) -> None:
        raise NotImplementedError

    def replied(self) -> bool:
        raise NotImplementedError

    def result(self) -> torch.Tensor:
        raise NotImplementedError


class SpeculativeDevice:
    def __init__(self, part: ModelPart, adapter: DraftAdapter, eta: float = 0.6) -> None:
        if not 0.0 <= eta <= 1.0:
            raise ValueError("eta must lie in [0, 1]")
        if part.embed_tokens is None or part.lm_head is None:
            raise ValueError("the device part needs the embedding and the LM head")
        self.part, self.adapter, self.eta = part, adapter, eta

    def new_state(self, capacity: int) -> SequenceState:
        return SequenceState(self.part, self.adapter, capacity)

    # -- shallow layers and adapter ------------------------------------------------------------------
    def shallow(self, state: SequenceState, token_ids: Sequence[int]) -> torch.Tensor:
        """Embedding + first m layers on new positions (a prompt chunk or one token); committed."""
        ids = torch.tensor(list(token_ids), dtype=torch.long)
        hidden = self.part.run_layers(self.part.embed(ids), [Segment(state.shallow_cache, len(ids))])
        state.unabsorbed.append(hidden)
        return hidden

    def absorb(self, state: SequenceState) -> Optional[torch.Tensor]:
        """Run the adapter over the committed shallow states it has not seen; returns its last output."""
        if not state.unabsorbed:
            return None
        hidden = torch.cat(state.unabsorbed) if len(state.unabsorbed) > 1 else state.unabsorbed[0]
        state.unabsorbed = []
        return self.adapter.run(hidden, [Segment(state.adapter_cache, hidden.shape[0])])[-1]

    def next_token(self, deep: torch.Tensor) -> torch.Tensor:
        """LM head + argmax on deep states [n, hidden] -> token ids [n]."""
        return torch.argmax(self.part.logits(deep.to(self.part.device)), dim=-1)

    # -- drafting ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, state: SequenceState, x: int, limit: int, resume: Optional[Branch] = None) -> Draft:
        """Draft up to ``limit`` tokens after x (Eq. 5 stops it), or go on from an adopted parallel draft."""
        start = state.length if resume is None else state.length - len(resume.tokens)
        tokens: List[int] = []
        probs: List[float] = []
        states: List[torch.Tensor] = []
        last: Optional[torch.Tensor] = None
        token = x
        if resume is not None:  # x and the branch's first drafts are already in the caches
            tokens, probs = list(resume.tokens), list(resume.probs)
            states = list(resume.shallow)
            last = resume.dists[len(tokens) - 1]
            token = tokens[-1]
        while True:
            hidden = self.shallow(state, [token])
            states.append(hidden)
            if len(tokens) >= limit or (probs and probs[-1] < self.eta):
                break  # d_k's shallow state stays unabsorbed until d_k is accepted
            deep = self.absorb(state)
            last = torch.softmax(self.part.logits(deep).float(), dim=-1)
            prob, chosen = torch.max(last, dim=-1)
            token = int(chosen)
            tokens.append(token)
            probs.append(float(prob))
        return Draft(start, tokens, probs, torch.cat(states), last, resume is not None)

    @staticmethod
    def candidates(draft: Draft, top_k: int) -> List[int]:
        """The top-k alternatives to d_k from the distribution it was drawn from (d_k itself left out)."""
        if not draft.tokens or draft.last_probs is None or top_k < 1:
            return []
        ranked = torch.topk(draft.last_probs, min(top_k + 1, draft.last_probs.shape[-1])).indices.tolist()
        return [t for t in ranked if t != draft.tokens[-1]][:top_k]

    @torch.inference_mode()
    def draft_branches(
        self,
        state: SequenceState,
        draft: Draft,
        candidates: Sequence[int],
        steps: int,
        stop: Callable[[], bool] = lambda: False,
    ) -> List[Branch]:
        """Parallel drafting: ``steps`` draft steps from every candidate at d_k's position, all candidates
        batched in each step; stops early when ``stop()`` says the verification is back."""
        if not candidates or steps < 1:
            return []
        at = draft.start + len(draft.tokens)  # d_k's position
        branches = [
            Branch(c, [], [], [], [], BranchCache(state.shallow_cache, at), BranchCache(state.adapter_cache, at))
            for c in candidates
        ]
        if state.adapter_cache.length != at:
            raise RuntimeError("the adapter holds %d positions, d_k sits at %d" % (state.adapter_cache.length, at))
        inputs = list(candidates)
        for _ in range(steps):
            if stop():
                break
            ids = torch.tensor(inputs, dtype=torch.long)
            shallow = self.part.run_layers(self.part.embed(ids), [Segment(b.shallow_cache, 1) for b in branches])
            deep = self.adapter.run(shallow, [Segment(b.adapter_cache, 1) for b in branches])
            dists = torch.softmax(self.part.logits(deep).float(), dim=-1)
            best, chosen = torch.max(dists, dim=-1)
            for i, b in enumerate(branches):
                b.shallow.append(shallow[i : i + 1])
                b.dists.append(dists[i])
                b.tokens.append(int(chosen[i]))
                b.probs.append(float(best[i]))
            inputs = chosen.tolist()
        return branches

    # -- verification --------------------------------------------------------------------------------
    @torch.inference_mode()
    def accept(
        self, state: SequenceState, draft: Draft, deep: torch.Tensor, branches: Sequence[Branch] = ()
    ) -> Verdict:
        """Greedy acceptance of ``draft`` against the LLM's deep states [k + 1, hidden]; rolls the device's
        caches back to x and the accepted drafts, and adopts a parallel draft when one matches."""
        k = len(draft.tokens)
        if deep.shape[0] != k + 1:
            raise ValueError("%d deep states for a draft of %d tokens" % (deep.shape[0], k))
        targets = self.next_token(deep).tolist()
        accepted = 0
        while accepted < k and draft.tokens[accepted] == targets[accepted]:
            accepted += 1
        emitted = draft.tokens[:accepted] + [targets[accepted]]
        committed = draft.start + accepted + 1
        state.shallow_cache.truncate(committed)
        state.adapter_cache.truncate(min(state.adapter_cache.length, committed))
        # d_k accepted: its shallow state (computed for verification) still has to pass the adapter
        state.unabsorbed = [draft.shallow[k:]] if accepted == k else []
        reused = None
        if accepted == k - 1:
            reused = next((b for b in branches if b.token == targets[accepted] and b.tokens), None)
        return Verdict(accepted, emitted, reused)

    @torch.inference_mode()
    def adopt(self, state: SequenceState, branch: Branch, limit: int) -> Optional[Branch]:
        """Make ``branch`` the sequence's continuation: its draft up to the first token below eta (Eq. 5)
        and at most ``limit`` tokens, with its cache entries committed. None when nothing is left."""
        keep = len(branch.tokens)
        for i, p in enumerate(branch.probs):
            if p < self.eta:
                keep = i + 1
                break
        keep = min(keep, limit)
        if keep < 1:
            return None
        branch.shallow_cache.commit(keep)
        branch.adapter_cache.commit(keep)
        state.unabsorbed = []
        return branch._replace(
            tokens=branch.tokens[:keep], probs=branch.probs[:keep], shallow=branch.shallow[:keep],
            dists=branch.dists[:keep],
        )  # fmt: skip


class LocalVerifier(Verifier):
    """Verification by a middle part in this process (tests and the reference generator)."""

    def __init__(self, middle: ModelPart, capacity: int) -> None:
        self.middle = middle
        self.cache = middle.new_cache(capacity)
        self._out: Optional[torch.Tensor] = None

    def submit(self, shallow: torch.Tensor, start: int) -> None:
        self.cache.truncate(start)  # the server's rollback: forget rejected positions
        with torch.inference_mode():
            self._out = self.middle.run_layers(shallow, [Segment(self.cache, shallow.shape[0])])

    def replied(self) -> bool:
        """Never: the local verification is done at once, and parallel drafting should still run its steps."""
        return False

    def result(self) -> torch.Tensor:
        out, self._out = self._out, None
        return out


class RoundLog(NamedTuple):
    drafted: int
    accepted: int
    reused: bool
    branch_steps: int


def speculative_rounds(
    device: SpeculativeDevice,
    verifier: Verifier,
    state: SequenceState,
    first_token: int,
    max_new_tokens: int,
    eos_id: Optional[int] = None,
    max_draft: int = 8,
    top_k: int = 0,
    branch_steps: Callable[[int], int] = lambda drafted: 0,
) -> Iterator[Tuple[Draft, Verdict, List[Branch]]]:
    """Rounds of speculative decoding after the prefill (whose last token is ``first_token``) until
    ``max_new_tokens`` are out or EOS; parallel drafting when top_k > 0 and ``branch_steps`` (lambda_i
    for a draft of that many tokens) is positive. Yields each round as it completes."""
    produced = 1
    last = first_token
    resume: Optional[Branch] = None
    while last != eos_id and produced < max_new_tokens:
        limit = min(max_draft, max_new_tokens - produced - 1)
        draft = device.draft(state, last, limit, resume)
        verifier.submit(draft.shallow, draft.start)
        candidates = device.candidates(draft, top_k)
        steps = branch_steps(len(draft.tokens)) if candidates else 0
        branches = device.draft_branches(state, draft, candidates, steps, verifier.replied)
        verdict = device.accept(state, draft, verifier.result(), branches)
        emitted = verdict.emitted
        if eos_id is not None and eos_id in emitted:
            emitted = emitted[: emitted.index(eos_id) + 1]
        verdict = verdict._replace(emitted=emitted[: max_new_tokens - produced])
        produced += len(verdict.emitted)
        last = verdict.emitted[-1]
        yield draft, verdict, branches
        resume = None
        if verdict.reused_branch is not None and last != eos_id:
            resume = device.adopt(state, verdict.reused_branch, min(max_draft, max_new_tokens - produced - 1))


def speculative_generate(
    device: SpeculativeDevice,
    verifier: Verifier,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_id: Optional[int] = None,
    max_draft: int = 8,
    top_k: int = 0,
    branch_steps: Callable[[int], int] = lambda drafted: 0,
) -> Tuple[List[int], List[RoundLog]]:
    """Greedy generation with speculative decoding in one process: (generated ids, one RoundLog per
    round). The ids equal ``greedy_generate``'s."""
    if max_new_tokens < 1:
        return [], []
    state = device.new_state(len(prompt_ids) + max_new_tokens + max_draft + 2)
    with torch.inference_mode():
        verifier.submit(device.shallow(state, prompt_ids), 0)
        device.absorb(state)
        out = [int(device.next_token(verifier.result()[-1:])[0])]
    rounds: List[RoundLog] = []
    for draft, verdict, branches in speculative_rounds(
        device, verifier, state, out[0], max_new_tokens, eos_id, max_draft, top_k, branch_steps
    ):
        out.extend(verdict.emitted)
        steps = len(branches[0].tokens) if branches else 0
        rounds.append(RoundLog(len(draft.tokens), verdict.accepted, draft.reused, steps))
    return out, rounds


def acceptance_length(rounds: Sequence[RoundLog]) -> float:
    """vLLM's mean acceptance length of ``rounds`` (see :mod:`nodes.contracts.speculative_metrics`); NaN
    without a round."""
    length = contract_acceptance_length(sum(r.accepted for r in rounds), len(rounds))
    return float("nan") if length is None else length
