"""A lean runner's static buffers and the CUDA graphs that run on them.

A graph reads and writes the tensors it was captured with, so the keys and
values it attends over must stay where they are. Here they belong to the runner,
one pair per cache capacity (Bank), and a session's cache moves in when it runs:
a copy of its keys and values, microseconds on a GPU. The session there before
keeps a copy of its own. So each feed length is captured once per process and
capacity (Step), whatever the session, and replayed after.
"""
from __future__ import annotations

import threading
import weakref

import torch

MAX_STATIC_ROWS = 16  # the longest feed a static step runs (a verify of k_max + 1 = 9 tokens fits)


class Bank:
    """The runner's keys and values of one capacity, which its static steps read
    and write, and those steps (Step), one per feed length. The cache that runs
    on them (the resident) holds these very tensors as its own; a cache that
    comes to run here has its keys and values copied in and takes them over, and
    the resident before it gets copies of its own. So the steps' tensors never
    change, and a graph of them is captured once, whatever the session."""

    def __init__(self, runner, kv):  # a tandem.lean.LeanRunner, and one of its StaticKV caches
        self.runner = runner
        self.keys, self.values = torch.zeros_like(kv.keys), torch.zeros_like(kv.values)
        capacity = kv.keys.shape[2]
        runner._rotary_table(capacity)
        self.cos, self.sin = runner.cos[:capacity], runner.sin[:capacity]
        self.resident: weakref.ref | None = None
        self.steps: dict[int, Step] = {}

    def admit(self, kv) -> None:
        if kv.keys is self.keys:
            return
        assert kv.keys.shape == self.keys.shape, (kv.keys.shape, self.keys.shape)
        resident = self.resident() if self.resident is not None else None
        if resident is not None and resident.keys is self.keys:
            resident.keys, resident.values = self.keys.clone(), self.values.clone()
        self.keys.copy_(kv.keys)
        self.values.copy_(kv.values)
        kv.keys, kv.values = self.keys, self.values
        self.resident = weakref.ref(kv)

    def step(self, rows: int) -> "Step":
        step = self.steps.get(rows)
        if step is None:
            step = self.steps[rows] = Step(self, rows)
        return step


# torch.cuda.graph synchronizes the device as it begins a capture, which fails
# while another thread of the process is capturing, and spoils that capture
# (seen on an H200 in the tests' cluster, whose two services share a process).
# So a process captures one graph at a time.
CAPTURE_LOCK = threading.Lock()


class Step:
    """LeanRunner.static_block of `rows` tokens on a bank's buffers. With the
    runner's graphs on, it is captured as a CUDA graph on its first call: two
    warm-up runs on a side stream (they write the same keys and values at the
    same positions as the replay after them), then the capture, then a replay
    per call. Each graph keeps its own memory pool for the step's intermediates
    (a few tokens' activations), which the session cache budget does not count."""

    WARMUPS = 2

    def __init__(self, bank: Bank, rows: int):
        self.bank, self.runner = bank, bank.runner
        self.tokens = torch.zeros(rows, dtype=torch.long, device=self.runner.device)
        self.position = torch.zeros(1, dtype=torch.long, device=self.runner.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None

    def _capture(self) -> None:
        device = self.runner.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(self.WARMUPS):
                self._run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.output = self._run()
        self.graph = graph

    def _run(self) -> torch.Tensor:
        bank = self.bank
        return self.runner.static_block(bank.keys, bank.values, self.tokens, self.position, bank.cos, bank.sin)

    def __call__(self, tokens: list[int], position: int) -> torch.Tensor:
        if len(tokens) == 1:
            self.tokens.fill_(tokens[0])
        else:
            self.tokens.copy_(torch.tensor(tokens, dtype=torch.long))
        self.position.fill_(position)
        if not self.runner.graphs:
            return self._run()
        if self.graph is None:
            with CAPTURE_LOCK:
                self._capture()
        self.graph.replay()
        return self.output
