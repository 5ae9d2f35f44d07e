"""Request traces for the offload simulator: generated (seeded) and saved/replayed as Parquet.

A trace is a list of :class:`TraceRequest`: when it arrives (in engine steps), its
prompt and output token ids, and the session it belongs to. A multi-turn session's
turn ``k+1`` arrives ``gap`` steps after turn ``k`` finished (a tool call) and its
prompt is turn ``k``'s prompt and output plus new tokens, as in an agent loop.
Users can record their own traffic in the same Parquet schema and replay it.

Generators:

- ``agents``: multi-turn sessions sharing one system prompt, with tool-call gaps;
- ``documents``: long documents, each asked several questions over time;
- ``stream``: one-shot prompts that are never seen again;
- ``mixed``: all three interleaved.

Real traffic: :func:`mooncake` replays the Mooncake FAST'25 conversation trace (one JSON
object a line: arrival in ms, input and output lengths, and the hashes of the prompt's
512-token blocks, equal hashes for equal prefixes), turning each block hash into the same
512 token ids wherever it appears, so the prompts share exactly the prefixes the trace says.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema([
    ("id", pa.string()),
    ("arrival", pa.int64()),
    ("session", pa.string()),
    ("after", pa.string()),  # a previous turn this one waits for ("" if none)
    ("gap", pa.int64()),  # steps after that turn finished
    ("prompt", pa.list_(pa.int32())),
    ("output", pa.list_(pa.int32())),
])


@dataclass
class TraceRequest:
    """One request of a trace: its arrival, its prompt's blocks (as hash ids) and its answer's length."""

    id: str
    arrival: int
    session: str
    prompt: list[int]
    output: list[int]
    after: str = ""
    gap: int = 0


def save(trace: list[TraceRequest], path: str) -> None:
    cols = {f: [getattr(r, f) for r in trace] for f in SCHEMA.names}
    pq.write_table(pa.table(cols, schema=SCHEMA), path)


def load(path: str) -> list[TraceRequest]:
    """Read a trace (ours, or traffic a user recorded in the same schema); checks the columns."""
    table = pq.read_table(path)
    missing = set(SCHEMA.names) - set(table.column_names)
    if missing:
        raise ValueError(f"{path}: not an lmkv trace, missing columns {sorted(missing)}")
    rows = table.select(SCHEMA.names).to_pylist()
    return [TraceRequest(id=r["id"], arrival=r["arrival"], session=r["session"], prompt=list(r["prompt"]),
                         output=list(r["output"]), after=r["after"] or "", gap=r["gap"] or 0) for r in rows]


def _tokens(rng: random.Random, n: int, vocab: int = 30000) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def agents(rng: random.Random, sessions: int, start: int, spread: int, system: list[int],
           turns: tuple[int, int] = (3, 8), msg: tuple[int, int] = (64, 512), out: tuple[int, int] = (32, 256),
           gap: tuple[int, int] = (5, 60)) -> list[TraceRequest]:
    reqs = []
    for s in range(sessions):
        history = list(system)
        prev = ""
        for t in range(rng.randint(*turns)):
            history = history + _tokens(rng, rng.randint(*msg))
            rid = f"agent{s}-t{t}"
            output = _tokens(rng, rng.randint(*out))
            reqs.append(TraceRequest(rid, start + rng.randrange(spread) if not prev else 0, f"agent{s}",
                                     list(history), output, prev, rng.randint(*gap) if prev else 0))
            history = history + output
            prev = rid
    return reqs


def documents(rng: random.Random, docs: int, start: int, spread: int, system: list[int],
              doc_tokens: tuple[int, int] = (2048, 6144), questions: tuple[int, int] = (2, 5)) -> list[TraceRequest]:
    reqs = []
    for d in range(docs):
        doc = system + _tokens(rng, rng.randint(*doc_tokens))
        for q in range(rng.randint(*questions)):
            reqs.append(TraceRequest(f"doc{d}-q{q}", start + rng.randrange(spread), f"doc{d}",
                                     doc + _tokens(rng, rng.randint(16, 96)), _tokens(rng, rng.randint(16, 128))))
    return reqs


def stream(rng: random.Random, n: int, start: int, spread: int, system: list[int]) -> list[TraceRequest]:
    return [TraceRequest(f"once{i}", start + rng.randrange(spread), f"once{i}",
                         system + _tokens(rng, rng.randint(256, 2048)), _tokens(rng, rng.randint(16, 256)))
            for i in range(n)]


def generate(kind: str, seed: int = 0, scale: float = 1.0) -> list[TraceRequest]:
    """A seeded trace; ``scale`` multiplies the number of sessions, documents and one-shot prompts."""
    rng = random.Random(seed)
    system = _tokens(rng, 512)
    spread = int(600 * scale)
    n = lambda k: max(1, int(k * scale))  # noqa: E731
    if kind == "agents":
        out = agents(rng, n(24), 0, spread, system)
    elif kind == "documents":
        out = documents(rng, n(12), 0, spread, system)
    elif kind == "stream":
        out = stream(rng, n(60), 0, spread, system)
    elif kind == "mixed":
        out = (agents(rng, n(12), 0, spread, system) + documents(rng, n(6), 0, spread, system)
               + stream(rng, n(30), 0, spread, _tokens(rng, 64)))
    else:
        raise ValueError(f"unknown trace kind {kind!r} (agents, documents, stream, mixed)")
    return sorted(out, key=lambda r: (r.arrival, r.id))


def _block_tokens(h: int, n: int) -> list[int]:
    """The token ids of a trace's block hash ``h`` (the same ids wherever ``h`` appears)."""
    return [(h * 0x9E3779B1 + j * 0x85EBCA77) % (1 << 31) for j in range(n)]


def mooncake(path: str | Path, seconds: float = 300.0, step_ms: float = 40.0, max_output: int = 32,
             block_tokens: int = 512) -> list[TraceRequest]:
    """The requests of a Mooncake-format trace that arrive in its first ``seconds``, arriving at
    step ``timestamp // step_ms``; outputs capped at ``max_output`` tokens (their ids are this
    request's own: the trace says nothing of what outputs share). ``path`` may be gzipped."""
    out = []
    blocks: dict[int, list[int]] = {}
    with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
        for i, line in enumerate(f):
            r = json.loads(line)
            if r["timestamp"] >= seconds * 1000:
                break
            prompt: list[int] = []
            for h in r["hash_ids"]:
                if h not in blocks:
                    blocks[h] = _block_tokens(h, block_tokens)
                prompt += blocks[h]
            prompt = prompt[: r["input_length"]]
            n_out = max(1, min(max_output, int(r["output_length"])))
            output = [(1 << 31) + (i * 131 + j) % 30000 for j in range(n_out)]
            out.append(TraceRequest(f"mc{i}", int(r["timestamp"] // step_ms), f"mc{i}", prompt, output))
    return out
