"""The experience buffer: per question, its latest success count k and its distinct correct trajectories.

Storage is columnar so that memory grows with stored tokens only: every trajectory's token ids (int32) and
behaviour log-probs (float32) live in two flat arrays, 8 bytes per token, and a few per-trajectory columns
(offset, length, owner question, collection step, weights version, replay count) index into them. Dropped
trajectories leave holes that are compacted away once they make up half of the arrays.

Collection rule (spec §2): a group of K rollouts with k correct is collected iff ``lbound < k <= rbound``
(default 0 < k <= K-1): the question moves to bucket k and its unseen correct trajectories are appended.
A 0/K group changes nothing, as in the released code: the question keeps its stale bucket and trajectories.
Retirement (entries dropped, never sampled or collected again) is the caller's one decision, `retire`: ExGRPO's
experience side retires a question whose own members were all correct (`exgrpo.training.experience_side`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from exgrpo.records import Trajectory
from exgrpo.runtime.atomic import replaced_on_success

_FORMAT_VERSION = 2  # 2: per-trajectory policy version and replay count


@dataclass(slots=True)  # one per question: slots keep the per-question overhead small
class _Question:
    bucket: int
    slots: list[int] = field(default_factory=list)  # trajectory slots, oldest first
    last_update: int = 0


class _GrowableArray:
    """A 1-D numpy array with amortised O(1) append of chunks."""

    def __init__(self, dtype, capacity: int = 1024):
        self.data = np.empty(capacity, dtype=dtype)
        self.size = 0

    def extend(self, values: np.ndarray) -> int:
        start, end = self.size, self.size + len(values)
        if end > len(self.data):
            # grow by 1.25x: amortised O(1) appends with little slack
            grown = np.empty(max(end, len(self.data) * 5 // 4), dtype=self.data.dtype)
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        self.data[start:end] = values
        self.size = end
        return start

    def view(self) -> np.ndarray:
        return self.data[: self.size]

    def reset(self, values: np.ndarray) -> None:
        self.data = np.array(values, dtype=self.data.dtype, copy=True)
        if len(self.data) == 0:
            self.data = np.empty(1024, dtype=self.data.dtype)
        self.size = len(values)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class ExperienceBuffer:
    """Question-keyed store of correct trajectories with correctness buckets and retirement.

    Args:
        num_generations: K, the group size; buckets are success counts in 1..K-1.
        lbound, rbound: collect a group iff ``lbound < k <= rbound``; rbound defaults to K-1.
        max_trajectories_per_question: keep only the newest this many per question (None: unbounded).
        max_questions: hold at most this many questions, evicting the least recently updated (None: unbounded).
    """

    @classmethod
    def from_config(cls, experience, num_generations: int) -> "ExperienceBuffer":
        """From the `experience` config section: collection bounds and capacity."""
        e = experience
        return cls(num_generations, lbound=e.lbound, rbound=e.rbound,
                   max_trajectories_per_question=e.max_trajectories_per_question, max_questions=e.max_questions)

    def __init__(
        self,
        num_generations: int = 8,
        lbound: int = 0,
        rbound: int | None = None,
        max_trajectories_per_question: int | None = None,
        max_questions: int | None = None,
    ):
        rbound = num_generations - 1 if rbound is None else rbound
        if num_generations < 2:
            raise ValueError(f"num_generations must be >= 2, got {num_generations}")
        if not 0 <= lbound < rbound <= num_generations - 1:
            raise ValueError(
                f"collection bounds must satisfy 0 <= lbound < rbound <= num_generations-1 "
                f"(= {num_generations - 1}); got lbound={lbound}, rbound={rbound}"
            )
        for name, cap in (("max_trajectories_per_question", max_trajectories_per_question),
                          ("max_questions", max_questions)):
            if cap is not None and cap < 1:
                raise ValueError(f"{name} must be None or >= 1, got {cap}")
        self.num_generations = num_generations
        self.lbound, self.rbound = lbound, rbound
        self.max_trajectories_per_question = max_trajectories_per_question
        self.max_questions = max_questions
        self._clear()

    def _clear(self) -> None:
        self._questions: dict[str, _Question] = {}
        self._buckets: dict[int, list[str]] = {}  # k -> question ids; swap-remove keeps it O(1)
        self._position: dict[str, int] = {}  # question id -> index in its bucket list
        self._retired: set[str] = set()
        self._tokens = _GrowableArray(np.int32)
        self._logprobs = _GrowableArray(np.float32)
        self._offset = _GrowableArray(np.int64)
        self._length = _GrowableArray(np.int32)
        self._step = _GrowableArray(np.int32)
        self._version = _GrowableArray(np.int32)
        self._uses = _GrowableArray(np.int32)
        self._owner = _GrowableArray(np.int64)  # -1 once dropped
        self._owner_names: list[str] = []  # owner index -> question id
        self._owner_index: dict[str, int] = {}
        self._dead_tokens = 0

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        """Number of questions holding at least one trajectory (the sampleable set V)."""
        return len(self._questions)

    def __contains__(self, question_id: str) -> bool:
        return question_id in self._questions

    @property
    def num_trajectories(self) -> int:
        return sum(len(q.slots) for q in self._questions.values())

    @property
    def num_tokens(self) -> int:
        return self._tokens.size - self._dead_tokens

    @property
    def retired(self) -> frozenset[str]:
        return frozenset(self._retired)

    def is_retired(self, question_id: str) -> bool:
        return question_id in self._retired

    @property
    def num_retired(self) -> int:
        return len(self._retired)

    def bucket_of(self, question_id: str) -> int | None:
        q = self._questions.get(question_id)
        return None if q is None else q.bucket

    def buckets(self) -> dict[int, list[str]]:
        """Non-empty buckets: success count k -> question ids (read-only view; do not mutate)."""
        return {k: ids for k, ids in sorted(self._buckets.items()) if ids}

    def bucket_histogram(self) -> dict[int, int]:
        return {k: len(ids) for k, ids in sorted(self._buckets.items()) if ids}

    def questions(self) -> list[str]:
        return list(self._questions)

    def trajectories(self, question_id: str) -> list[Trajectory]:
        """The stored trajectories of a question, oldest first (copies)."""
        return [self._trajectory(slot) for slot in self._questions[question_id].slots]

    def _trajectory(self, slot: int) -> Trajectory:
        start, length = int(self._offset.data[slot]), int(self._length.data[slot])
        return Trajectory(
            token_ids=self._tokens.data[start : start + length].copy(),
            logprobs=self._logprobs.data[start : start + length].copy(),
            step=int(self._step.data[slot]),
            version=int(self._version.data[slot]),
            uses=int(self._uses.data[slot]),
        )

    @property
    def nbytes(self) -> int:
        """Bytes held by the columnar arrays (capacity included)."""
        return sum(a.nbytes for a in self._columns().values())

    def _columns(self) -> dict[str, _GrowableArray]:
        return {"tokens": self._tokens, "logprobs": self._logprobs, "offset": self._offset, "length": self._length,
                "step": self._step, "version": self._version, "uses": self._uses, "owner": self._owner}

    # ------------------------------------------------------------------ updates
    def update_group(
        self,
        question_id: str,
        correct: Sequence[bool],
        token_ids: Sequence[np.ndarray] | None = None,
        logprobs: Sequence[np.ndarray] | None = None,
        step: int = 0,
        version: int = -1,
    ) -> str:
        """Apply one group's outcome. Returns what happened: "collected", "skipped" (k outside the bounds) or
        "ignored" (a retired question).

        Args:
            question_id: the question's stable id.
            correct: (K,) whether each member of the group was correct (a replayed member included).
            token_ids: per member, its response token ids; needed only for correct members.
            logprobs: per member, the behaviour log-probs of those tokens (same lengths).
            step: the training step, stored with new trajectories.
            version: the weights version (applied optimizer steps) of the behaviour log-probs.
        """
        if len(correct) != self.num_generations:
            raise ValueError(f"group of {question_id!r} has {len(correct)} members, expected {self.num_generations}")
        if question_id in self._retired:
            return "ignored"
        k = int(sum(bool(c) for c in correct))
        if not self.lbound < k <= self.rbound:
            return "skipped"
        if token_ids is None or logprobs is None:
            raise ValueError("token_ids and logprobs are required to collect a group")
        self._set_bucket(question_id, k, step)
        for ok, ids, lps in zip(correct, token_ids, logprobs):
            if ok:
                ids, lps = np.asarray(ids, dtype=np.int32), np.asarray(lps, dtype=np.float32)
                self._add_trajectory(question_id, ids, lps, step, version)
        self._enforce_question_cap()
        return "collected"

    def record_replay(self, question_id: str, token_ids: np.ndarray) -> None:
        """Count one use of the stored trajectory of `question_id` with these token ids (a replay trained on)."""
        q = self._questions.get(question_id)
        slot = None if q is None else self._slot_of(q, np.asarray(token_ids, dtype=np.int32))
        if slot is None:
            raise KeyError(f"question {question_id!r} stores no trajectory with these {len(token_ids)} tokens")
        self._uses.data[slot] += 1

    def _slot_of(self, q: _Question, ids: np.ndarray) -> int | None:
        for slot in q.slots:  # a question holds few trajectories
            if self._length.data[slot] == len(ids):
                start = int(self._offset.data[slot])
                if np.array_equal(self._tokens.data[start : start + len(ids)], ids):
                    return slot
        return None

    def retire(self, question_id: str) -> None:
        """Retire a question for good: drop its entries; it is never sampled again."""
        self._retired.add(question_id)
        self._drop_question(question_id)

    def _set_bucket(self, question_id: str, k: int, step: int) -> None:
        q = self._questions.get(question_id)
        if q is None:
            q = self._questions[question_id] = _Question(bucket=k)
            self._bucket_add(question_id, k)
        elif q.bucket != k:
            self._bucket_remove(question_id, q.bucket)
            q.bucket = k
            self._bucket_add(question_id, k)
        q.last_update = step

    def _bucket_add(self, question_id: str, k: int) -> None:
        members = self._buckets.setdefault(k, [])
        self._position[question_id] = len(members)
        members.append(question_id)

    def _bucket_remove(self, question_id: str, k: int) -> None:
        members = self._buckets[k]
        i = self._position.pop(question_id)
        last = members.pop()
        if last != question_id:
            members[i] = last
            self._position[last] = i

    def _add_trajectory(self, question_id: str, ids: np.ndarray, lps: np.ndarray, step: int, version: int) -> None:
        if ids.shape != lps.shape or ids.ndim != 1:
            raise ValueError(f"token_ids {ids.shape} and logprobs {lps.shape} must be equal-length 1-D arrays")
        if len(ids) == 0:
            raise ValueError(f"empty trajectory for question {question_id!r}")
        q = self._questions[question_id]
        if self._slot_of(q, ids) is not None:  # dedup by token ids
            return
        owner = self._owner_index.get(question_id)
        if owner is None:
            owner = self._owner_index[question_id] = len(self._owner_names)
            self._owner_names.append(question_id)
        offset = self._tokens.extend(ids)
        self._logprobs.extend(lps)
        slot = self._offset.extend(np.array([offset], dtype=np.int64))
        self._length.extend(np.array([len(ids)], dtype=np.int32))
        self._step.extend(np.array([step], dtype=np.int32))
        self._version.extend(np.array([version], dtype=np.int32))
        self._uses.extend(np.array([0], dtype=np.int32))
        self._owner.extend(np.array([owner], dtype=np.int64))
        q.slots.append(slot)
        cap = self.max_trajectories_per_question
        if cap is not None and len(q.slots) > cap:
            for old in q.slots[:-cap]:
                self._drop_slot(old)
            del q.slots[:-cap]

    def _drop_slot(self, slot: int) -> None:
        self._owner.data[slot] = -1
        self._dead_tokens += int(self._length.data[slot])

    def _drop_question(self, question_id: str) -> None:
        q = self._questions.pop(question_id, None)
        if q is None:
            return
        self._bucket_remove(question_id, q.bucket)
        for slot in q.slots:
            self._drop_slot(slot)
        if self._dead_tokens * 2 > self._tokens.size:
            self._compact()

    def _enforce_question_cap(self) -> None:
        cap = self.max_questions
        while cap is not None and len(self._questions) > cap:
            stalest = min(self._questions, key=lambda qid: self._questions[qid].last_update)
            self._drop_question(stalest)

    def _compact(self) -> None:
        """Rewrite the arrays without dropped trajectories (keeps slot order)."""
        alive = np.flatnonzero(self._owner.view() >= 0)
        offsets, lengths = self._offset.view()[alive], self._length.view()[alive]
        token_index = _ranges(offsets, lengths)
        new_offsets = np.zeros(len(alive), dtype=np.int64)
        np.cumsum(lengths[:-1], out=new_offsets[1:])
        self._tokens.reset(self._tokens.view()[token_index])
        self._logprobs.reset(self._logprobs.view()[token_index])
        self._offset.reset(new_offsets)
        self._length.reset(lengths)
        for column in (self._step, self._version, self._uses, self._owner):
            column.reset(column.view()[alive])
        new_slot = {int(old): new for new, old in enumerate(alive)}
        for q in self._questions.values():
            q.slots = [new_slot[s] for s in q.slots]
        self._dead_tokens = 0

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict:
        """Arrays (numpy) and JSON-able metadata that fully describe the buffer; compacts first."""
        if self._dead_tokens:
            self._compact()
        questions = [
            {"id": qid, "bucket": q.bucket, "slots": q.slots, "last_update": q.last_update}
            for qid, q in self._questions.items()
        ]
        meta = {
            "format_version": _FORMAT_VERSION,
            "num_generations": self.num_generations,
            "lbound": self.lbound,
            "rbound": self.rbound,
            "max_trajectories_per_question": self.max_trajectories_per_question,
            "max_questions": self.max_questions,
            "questions": questions,
            "bucket_order": {str(k): ids for k, ids in self._buckets.items()},
            "retired": sorted(self._retired),
            "owners": self._owner_names,
        }
        arrays = {name: column.view().copy() for name, column in self._columns().items()}
        return {"meta": meta, "arrays": arrays}

    def load_state_dict(self, state: dict) -> None:
        meta, arrays = state["meta"], state["arrays"]
        if meta.get("format_version") == 1:  # written before versions and use counts were recorded
            n = len(arrays["step"])
            arrays = {**arrays, "version": np.full(n, -1, np.int32), "uses": np.zeros(n, np.int32)}
        elif meta.get("format_version") != _FORMAT_VERSION:
            raise ValueError(f"unsupported experience buffer format {meta.get('format_version')!r}")
        if meta["num_generations"] != self.num_generations:
            raise ValueError(
                f"buffer was saved with num_generations={meta['num_generations']}, this run uses {self.num_generations}"
            )
        self.__init__(
            meta["num_generations"], meta["lbound"], meta["rbound"],
            meta["max_trajectories_per_question"], meta["max_questions"],
        )
        for name, column in self._columns().items():
            column.reset(arrays[name])
        self._owner_names = list(meta["owners"])
        self._owner_index = {qid: i for i, qid in enumerate(self._owner_names)}
        for entry in meta["questions"]:
            self._questions[entry["id"]] = _Question(entry["bucket"], list(entry["slots"]), entry["last_update"])
        for k, ids in meta["bucket_order"].items():
            self._buckets[int(k)] = list(ids)
            self._position.update({qid: i for i, qid in enumerate(ids)})
        self._retired = set(meta["retired"])

    def save(self, path: str | os.PathLike) -> None:
        """Write to a safetensors file (see `write_state`)."""
        write_state(self.state_dict(), path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ExperienceBuffer":
        state = read_state(path)
        buffer = cls(state["meta"]["num_generations"])
        buffer.load_state_dict(state)
        return buffer

    def fingerprint(self) -> str:
        """A hash of the logical content (questions, buckets, trajectories, retired set); equal buffers agree."""
        import hashlib

        h = hashlib.sha256()
        for qid in sorted(self._questions):
            q = self._questions[qid]
            h.update(f"{qid}|{q.bucket}|{len(q.slots)}".encode())
            for t in self.trajectories(qid):
                h.update(t.token_ids.tobytes())
                h.update(t.logprobs.tobytes())
                h.update(f"{t.step}|{t.version}|{t.uses}".encode())
        h.update("|".join(sorted(self._retired)).encode())
        return h.hexdigest()


def write_state(state: dict, path: str | os.PathLike) -> None:
    """A buffer `state_dict` as one safetensors file: arrays + JSON metadata, nothing pickled; atomic."""
    from safetensors.numpy import save_file

    with replaced_on_success(path) as tmp:
        save_file(state["arrays"], str(tmp), metadata={"exgrpo_buffer": json.dumps(state["meta"])})


def read_state(path: str | os.PathLike) -> dict:
    """The `state_dict` written by `write_state`; a file that is not one is a ValueError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            meta_json = (f.metadata() or {}).get("exgrpo_buffer")
            if meta_json is None:
                raise ValueError(f"{path}: not an exgrpo experience buffer (no 'exgrpo_buffer' metadata)")
            arrays = {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as e:  # truncated or not safetensors at all
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    return {"meta": json.loads(meta_json), "arrays": arrays}


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n > 0), without a Python loop."""
    if len(starts) == 0:
        return np.empty(0, dtype=np.int64)
    steps = np.ones(int(lengths.sum()), dtype=np.int64)
    steps[0] = starts[0]
    steps[np.cumsum(lengths)[:-1]] = starts[1:] - (starts[:-1] + lengths[:-1]) + 1
    return np.cumsum(steps)
