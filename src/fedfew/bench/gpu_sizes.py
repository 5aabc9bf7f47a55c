"""The GPU readiness check's modes (``cuda``: the issue's sizes; ``cpu``: the smoke mode), its
sections, targets and time caps, the device it runs on, and its event lines."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fedfew.bench.common import detect_device
from fedfew.bench.synthetic import CIFAR_POOL


GPU_CHECK_SECTIONS = ("correctness", "speed", "memory", "precision", "paper")
#: targets of the issue (the vmap and projection ones are TARGET_VMAP_GPU, TARGET_PROJECTION_S)
TARGET_MEMORY_RATIO = 1.2
CORRECTNESS_ATOL = 1e-4
PAPER_ROUNDS = 2000
#: the paper's CIFAR-10 setting (besides M=20, K=3, E=1 and the dataset's lr 0.005, batch 50)
PAPER_OVERRIDES = ("partition=dirichlet", "partition.alpha=0.5")
_EVENT = "GPU_CHECK "


@dataclass(frozen=True)
class CheckSizes:
    """Sizes and time caps of one gpu-check mode: ``cuda`` (the issue's sizes) or ``cpu``
    (the smoke mode: the same code paths at tiny sizes, under a minute).

    Attributes:
        budget_s: the whole check's wall time at most (from the script's start), seconds.
        engine_clients: the vmap engine's ``engine_clients`` in every section but the
            memory one: ``auto`` on a GPU; a small number on the CPU, where ``auto`` trains one
            client at a time and would leave the multi-client chunks untested.
        correctness_M, correctness_image_sizes, correctness_text_sizes: clients and samples
            per client (cycled; unequal, so chunks pad with zero-weight rows) of the loop-vs-vmap check.
        text_length: tokens per text in the correctness check (fixed-length synthetic batches).
        text_vocab: vocabulary of the synthetic texts (AG News's 23,868 on a GPU; small on the
            CPU, where the dense word-vector update would dominate).
        speed_M: clients of the speed section (the issue's M=20 on a GPU).
        speed_pool: CIFAR-10-shaped samples split evenly among the speed clients (60,000 = the
            whole CIFAR-10: 2,250 train samples per client at M=20).
        speed_warmup: clients in the warm-up round before each timed round.
        text_per_client: synthetic AG-News-like texts per client (TextCNN speed).
        memory_pool: CIFAR-10-shaped samples split among the M clients of the memory section.
        memory_points: (M, K, engine_clients) of the memory section: the first five share
            one chunk width (so M and K act alone; the first point is the reference), the last
            uses ``auto``.
        cifar_pool: samples of the synthetic stand-in when the real CIFAR-10 is absent.
        cifar_per_class: (train, test) images per class to unpack (None: both tarballs whole;
            a subset is taken from the small test tarball alone, see :func:`unpack_cifar`).
        peak_size, peak_seconds: the square matmul of the FLOP/s peaks (None: 8192 on a GPU).
        threads: torch threads of the check's processes (None: torch's default; 1 in the
            smoke mode, which shares its cores with the data process).
        precision_M, precision_rounds: the bf16-mixed vs fp32 runs.
        paper_M, paper_seconds, paper_eval_every: the paper's run (rounds until the seconds
            are spent, evaluation every so many rounds).
        caps: seconds per section at most. keep: seconds kept back for each later section.
        grace_s: how long past its deadline a section may run before the driver kills it.
    """

    mode: str
    budget_s: float
    engine_clients: str
    correctness_M: int
    correctness_image_sizes: tuple[int, ...]
    correctness_text_sizes: tuple[int, ...]
    text_length: int
    text_vocab: int
    speed_M: int
    speed_pool: int
    speed_warmup: int
    text_per_client: int
    memory_pool: int
    memory_points: tuple[tuple[int, int, str], ...]
    cifar_pool: int
    cifar_per_class: tuple[int, int] | None
    precision_M: int
    precision_rounds: int
    paper_M: int
    paper_seconds: float
    paper_eval_every: int
    peak_size: int | None
    peak_seconds: float
    threads: int | None
    caps: dict
    keep: dict
    grace_s: float


CHECK_SIZES = {
    "cuda": CheckSizes(
        mode="cuda", budget_s=420.0, engine_clients="auto",
        correctness_M=8, correctness_image_sizes=(150, 97, 120, 64), correctness_text_sizes=(260, 130, 201, 90),
        text_length=64, text_vocab=23_868, speed_M=20, speed_pool=CIFAR_POOL, speed_warmup=20, text_per_client=2000,
        memory_pool=CIFAR_POOL,
        memory_points=((20, 3, "20"), (100, 3, "20"), (1000, 3, "20"), (20, 1, "20"), (20, 10, "20"), (1000, 3, "auto")),
        cifar_pool=CIFAR_POOL, cifar_per_class=None, precision_M=20, precision_rounds=20,
        paper_M=20, paper_seconds=180.0, paper_eval_every=10, peak_size=None, peak_seconds=1.0, threads=None,
        caps={"correctness": 60, "speed": 150, "memory": 90, "precision": 90, "paper": 230},
        keep={"correctness": 15, "speed": 40, "memory": 20, "precision": 30, "paper": 60},
        grace_s=45.0,
    ),
    "cpu": CheckSizes(
        mode="cpu", budget_s=300.0, engine_clients="3",
        correctness_M=4, correctness_image_sizes=(75, 40, 30, 20), correctness_text_sizes=(140, 60, 40, 30),
        text_length=32, text_vocab=2000, speed_M=4, speed_pool=4 * 20, speed_warmup=2, text_per_client=20,
        memory_pool=160,
        memory_points=((4, 3, "2"), (8, 3, "2"), (16, 3, "2"), (4, 1, "2"), (4, 5, "2"), (16, 3, "auto")),
        cifar_pool=160, cifar_per_class=(12, 4), precision_M=4, precision_rounds=2,
        paper_M=4, paper_seconds=1.0, paper_eval_every=2, peak_size=512, peak_seconds=0.2, threads=1,
        # generous: a safety net against hangs on a slow shared machine (a normal run takes < 60 s)
        caps={"correctness": 120, "speed": 120, "memory": 120, "precision": 120, "paper": 60},
        keep={"correctness": 10, "speed": 10, "memory": 10, "precision": 10, "paper": 10},
        grace_s=60.0,
    ),
}


def resolve_device(choice: str) -> str:
    """``auto`` | ``cpu`` | ``cuda`` -> the device the check runs on.

    Raises:
        ValueError: ``cuda`` asked for but torch sees no CUDA device.
    """
    import torch

    device = detect_device(choice)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False); "
                         "use --device auto or cpu for the CPU smoke mode")
    return device


def _set_threads(sizes: "CheckSizes") -> None:
    if sizes.threads:
        import torch

        torch.set_num_threads(sizes.threads)


def _emit(section: str, event: str, **fields: Any) -> None:
    """One protocol line for the driver: ``GPU_CHECK {"section", "event", ...}``."""
    from fedfew.core.io import to_jsonable

    print(_EVENT + json.dumps(to_jsonable({"section": section, "event": event, **fields})), flush=True)
