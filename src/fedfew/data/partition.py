"""Client partitions: split a pooled dataset into per-client train/test/(val) index sets.

Entry point :func:`partition_clients` runs two stages:

1. **Assignment** -- one function per scheme, looked up in :data:`PARTITIONS` by
   ``cfg.name``, gives every sample an owner client (or ``-1`` for "unassigned"):

   * ``iid`` -- random permutation cut into M near-equal parts (McMahan et al., 2017,
     "Communication-Efficient Learning of Deep Networks from Decentralized Data").
   * ``dirichlet`` -- per-class client proportions ~ Dir(alpha * 1_M) (Hsu, Qi & Brown,
     2019, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
     Classification"; the PFLlib / NIID-Bench implementation without its size re-weighting).
   * ``pathological`` -- every client holds exactly ``classes_per_client`` labels, label
     shards of (near-)equal size (McMahan et al., 2017, shard partition; made exact).
   * ``natural`` -- one client per natural group (writer, speaker, centre), as in LEAF
     (Caldas et al., 2018, "LEAF: A Benchmark for Federated Settings").
   * ``clustered`` -- clients in G known groups, each group seeing the data through its own
     transform (rotation or label permutation, :mod:`fedfew.data.groups`), the samples of a
     group split among its clients by ``within`` (iid, dirichlet or pathological): IFCA's
     rotated MNIST (Ghosh et al., 2020). Each ClientSplit then carries its ``group``.

2. **Per-client split** into train / test (and optionally validation), stratified by label
   (see :func:`partition_clients` for the exact counting rule).

Documented rules (the ones a reader of a paper table needs to know):

* **Randomness.** Only ``np.random.default_rng``-compatible generators seeded from the
  partition ``seed``: ``SeedSequence(seed)`` spawns one child stream for the assignment and
  one for the train/test/val split. Same seed -> identical partition (and hash); the seed is
  independent of any model/training seed.
* **iid leftovers.** ``N = q*M + r``: every client gets ``q`` samples, clients ``0..r-1``
  (in id order) get one more; so sizes differ by at most one.
* **dirichlet retries.** A draw is accepted when every client has at least
  ``max(min_size, smallest viable size)`` samples, where the smallest viable size is what
  the train/test(/val) split needs (e.g. 2 for train+test); with ``keep_official_test``
  every client must also receive >= 1 official-train and >= 1 official-test sample. After
  ``max_retries`` rejected draws, :class:`PartitionError`. ``M * min_size > N`` fails at once.
* **pathological holders.** With K classes present, the ``M * classes_per_client`` label
  slots are spread so that every class is held by ``q = (M*s) // K`` or ``q + 1`` clients;
  the ``r = M*s - q*K`` extra holders go to the r *largest* classes (ties broken at random).
  If ``M*s < K`` only the ``M*s`` largest classes are used and the **samples of the unused
  classes are left unassigned** (``partition_summary`` reports them). Label sets are drawn
  client by client, each pick proportional to the remaining holder slots of a class (like
  drawing McMahan's shards at random) with the forced picks that keep the draw always
  completable, so every client has exactly ``s`` distinct labels by construction.
* **pathological leftovers.** A class with ``n`` samples and ``u`` holders gives each holder
  ``n // u`` samples; the ``n % u`` remaining samples go one each to the holders with the
  currently smallest client size (ties at random), classes processed in random order. So a
  class's shards differ by at most one sample, and no client collects all leftovers. With
  equal class sizes and K dividing M*s, client sizes differ by at most ``s``.
* **natural clients.** ``num_clients=None`` (``num_clients=null``, FEMNIST's default): one
  client per group found, client ``i`` the ``i``-th group in sorted id order. An integer
  ``num_clients`` >= 1 is a cap: with more groups than that, ``partition.client_sample``
  chooses which groups become clients, ``first`` (default: the first ``num_clients`` in sorted
  id order) or ``random`` (a uniform sample without replacement from the partition seed's
  assignment stream), the chosen groups again in sorted id order, and the other groups'
  samples stay unassigned. A cap above the number of groups is an error, as is
  ``num_clients <= 0`` (the config rule: null or an integer >= 1).
* **official test split.** ``keep_official_test=true`` with an ``official_test`` mask: the
  scheme is applied to the official-train and official-test samples separately with the same
  client structure (iid: each part split evenly; dirichlet: the same proportion matrix;
  pathological: the same label holders), a client's train comes only from official-train
  samples and its test only from official-test samples, and ``test_fraction`` is ignored.
  ``natural`` always uses a group's own official train/test samples when the mask is given
  (LEAF layout). ``keep_official_test=true`` without a mask warns and falls back to
  ``test_fraction``.

Samples are assigned exactly once, except the unassigned cases above.
"""
from __future__ import annotations

import hashlib
import math
import warnings
from typing import Any, Callable, Mapping

import numpy as np

from fedfew.data.base import ClientSplit

__all__ = [
    "PARTITIONS",
    "PartitionError",
    "partition_clients",
    "partition_hash",
    "partition_summary",
    "partition_iid",
    "partition_dirichlet",
    "partition_pathological",
    "partition_natural",
]

_EPS = 1e-9  # guards floor(f * n) against 0.29 * 100 == 28.999999999999996


class PartitionError(ValueError):
    """An impossible partition request; the message says what failed and what to change."""


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def _as_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, without importing torch here
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default)
    return default if value is None else value


def _fraction_test_count(n: np.ndarray, fraction: float) -> np.ndarray:
    """Number of samples taken out of a client of size ``n``: round-half-up(fraction * n),
    clamped to ``[1, n - 1]`` (so both sides keep at least one sample; ``n >= 2``)."""
    n = np.asarray(n, dtype=np.int64)
    take = np.floor(fraction * n + 0.5 + _EPS).astype(np.int64)
    return np.clip(take, 1, np.maximum(n - 1, 1))


def _stratified_take(
    owner: np.ndarray, labels: np.ndarray, num_clients: int, fraction: float, rng: np.random.Generator
) -> np.ndarray:
    """Pick, per client, ``_fraction_test_count(n, fraction)`` samples stratified by label.

    Args:
        owner: (K,) int64 client of each candidate sample (every client present has >= 2).
        labels: (K,) int64 label of each candidate sample.
    Returns:
        (K,) bool, True for the picked samples.

    Rule (largest remainder, vectorised over all clients at once): a client's class with
    ``k`` samples first gets ``floor(fraction * k)`` picks; the client's remaining picks go
    one each to its classes with the largest fractional part ``fraction*k - floor(.)``
    (ties at random). Hence every class gets ``floor`` or ``ceil`` of ``fraction * k`` and
    the picked samples inside a class are uniformly random.
    """
    K = len(owner)
    if K == 0:
        return np.zeros(0, dtype=bool)
    n = np.bincount(owner, minlength=num_clients)
    target = _fraction_test_count(n, fraction)
    C = int(labels.max()) + 1
    cell = owner.astype(np.int64) * C + labels
    order = np.lexsort((rng.random(K), cell))  # by cell, random inside a cell
    cs = cell[order]
    start = np.flatnonzero(np.r_[True, cs[1:] != cs[:-1]])
    k = np.diff(np.r_[start, K])
    cell_client = cs[start] // C
    base = np.minimum(np.floor(fraction * k + _EPS).astype(np.int64), k)
    frac = np.maximum(fraction * k - base, 0.0)
    extra = target - np.bincount(cell_client, weights=base, minlength=num_clients).astype(np.int64)
    o2 = np.lexsort((rng.random(len(k)), -frac, cell_client))
    cc = cell_client[o2]
    rank = np.arange(len(o2)) - np.searchsorted(cc, cc, side="left")
    add = np.zeros(len(k), dtype=np.int64)
    add[o2] = rank < extra[cc]
    take = np.minimum(base + add, k)
    cell_of = np.repeat(np.arange(len(k)), k)
    picked_sorted = (np.arange(K) - start[cell_of]) < take[cell_of]
    picked = np.empty(K, dtype=bool)
    picked[order] = picked_sorted
    return picked


def _sorted_by_label(idx: np.ndarray, targets: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``idx`` ordered by label, uniformly shuffled inside each label."""
    return idx[np.lexsort((rng.random(len(idx)), targets[idx]))]


def _dirichlet_proportions(rng: np.random.Generator, alpha: float, rows: int, cols: int) -> np.ndarray:
    """(rows, cols) float64 matrix, each row ~ Dir(alpha * 1_cols), never NaN.

    Sampled as normalised gamma variates; for tiny alpha every variate of a row can underflow
    to 0 (numpy's own ``dirichlet`` then returns NaN): such a row puts all its mass on one
    uniformly random column, which is the alpha -> 0 limit of the Dirichlet distribution.
    """
    g = rng.standard_gamma(alpha, size=(rows, cols))
    total = g.sum(axis=1)
    zero = np.flatnonzero(~(total > 0))
    if len(zero):
        g[zero] = 0.0
        g[zero, rng.integers(0, cols, size=len(zero))] = 1.0
        total[zero] = 1.0
    return g / total[:, None]


def _split_counts(props: np.ndarray, n: np.ndarray) -> np.ndarray:
    """(C, M) samples per (class, client): class c's n[c] samples cut at floor(cumsum * n)."""
    cut = np.floor(np.cumsum(props, axis=1) * n[:, None] + _EPS).astype(np.int64)
    cut = np.minimum(cut, n[:, None])
    cut[:, -1] = n
    return np.diff(cut, axis=1, prepend=0)


class _Plan:
    """The split requirements shared by the schemes (what makes a client viable)."""

    def __init__(self, cfg: Any, official: bool) -> None:
        self.official = official
        self.test_fraction = float(_get(cfg, "test_fraction", 0.25))
        self.val_fraction = float(_get(cfg, "val_fraction", 0.0))
        if not official and not 0.0 < self.test_fraction < 1.0:
            raise PartitionError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise PartitionError(f"val_fraction must be in [0, 1), got {self.val_fraction}")

    def viable(self, sizes: np.ndarray) -> np.ndarray:
        """(M,) bool: can a client with ``sizes`` samples (per part: (P, M)) be split?"""
        sizes = np.atleast_2d(sizes)
        need_train = 2 if self.val_fraction > 0 else 1
        if self.official:
            return (sizes[0] >= need_train) & (sizes[1] >= 1)
        n = sizes[0]
        n_train = n - _fraction_test_count(n, self.test_fraction)
        return (n >= 2) & (n_train >= need_train)

    def min_viable(self) -> int:
        """Smallest total client size that can be viable."""
        need_train = 2 if self.val_fraction > 0 else 1
        if self.official:
            return need_train + 1
        n = 2
        while not self.viable(np.array([n]))[0]:
            n += 1
        return n


# --------------------------------------------------------------------------------------
# schemes: (targets, num_clients, cfg, rng, parts, groups, plan) -> (owner, num_clients)
#   parts: list of (n_p,) int64 index arrays (one part, or [official-train, official-test])
#   owner: (N,) int64 client id per sample, -1 = unassigned
# --------------------------------------------------------------------------------------
def partition_iid(
    targets: np.ndarray,
    num_clients: int | None,
    cfg: Mapping[str, Any],
    rng: np.random.Generator,
    parts: list[np.ndarray],
    groups: np.ndarray | None = None,
    plan: "_Plan | None" = None,
) -> tuple[np.ndarray, int]:
    """IID partition (McMahan et al., 2017): each part is randomly permuted and cut into M
    near-equal pieces; with ``N = q*M + r`` clients ``0..r-1`` get ``q + 1`` samples.

    Args:
        targets: (N,) int64 labels (unused except for the size).
        parts: list of (n_p,) int64 sample indices partitioned independently.
    Returns:
        ``(owner, M)``: (N,) int64 client per sample (all assigned) and the client count.
    Raises:
        PartitionError: only through the later per-client split (too few samples).
    """
    M = _require_clients(num_clients)
    owner = np.full(len(targets), -1, dtype=np.int64)
    for part in parts:
        q, r = divmod(len(part), M)
        sizes = np.full(M, q, dtype=np.int64)
        sizes[:r] += 1
        owner[rng.permutation(part)] = np.repeat(np.arange(M), sizes)
    return owner, M


def partition_dirichlet(
    targets: np.ndarray,
    num_clients: int | None,
    cfg: Mapping[str, Any],
    rng: np.random.Generator,
    parts: list[np.ndarray],
    groups: np.ndarray | None = None,
    plan: "_Plan | None" = None,
) -> tuple[np.ndarray, int]:
    """Label-skew Dirichlet partition (Hsu, Qi & Brown, 2019; PFLlib style).

    For every class present, client proportions p ~ Dir(alpha * 1_M) (gamma sampling, no NaN
    even for alpha = 0.01); the class's shuffled samples are cut at ``floor(cumsum(p) * n_c)``.
    The whole (C, M) draw is repeated until every client has at least ``max(min_size,
    smallest viable size)`` samples (see module doc). With ``keep_official_test`` the same
    proportion matrix cuts the official-train and the official-test samples.

    Args:
        targets: (N,) int64 labels.
        parts: list of (n_p,) int64 sample indices (one part or official train/test).
        cfg: keys ``alpha`` (> 0, required), ``min_size`` (default 10), ``max_retries``
            (default 100).
    Returns:
        ``(owner, M)``: (N,) int64 client per sample (all assigned) and M.
    Raises:
        PartitionError: alpha missing or <= 0; ``M * min_size > N``; no accepted draw after
            ``max_retries`` draws (the message names alpha, M and min_size and what to change).
    """
    M = _require_clients(num_clients)
    alpha = cfg.get("alpha", None)
    if alpha is None:
        raise PartitionError("dirichlet partition needs `alpha` (e.g. partition.alpha=0.5)")
    alpha = float(alpha)
    if not (alpha > 0 and math.isfinite(alpha)):
        raise PartitionError(f"dirichlet alpha must be a positive finite number, got {alpha}")
    min_size = int(_get(cfg, "min_size", 10))
    max_retries = int(_get(cfg, "max_retries", 100))
    if min_size < 0:
        raise PartitionError(f"dirichlet min_size must be >= 0, got {min_size}")
    if max_retries < 1:
        raise PartitionError(f"dirichlet max_retries must be >= 1, got {max_retries}")
    N = sum(len(p) for p in parts)
    need = max(min_size, plan.min_viable())
    smallest = max(plan.min_viable(), 2)  # the least min_size the config allows and the splits need
    if M * need > N:
        raise PartitionError(
            f"dirichlet partition impossible: M={M} clients x min_size={min_size} (effective minimum {need} "
            f"samples per client) > N={N} samples, so no alpha can help (alpha={alpha}); "
            + _fixes(f"num_clients <= {N // need}" if N >= need else None,
                     f"partition.min_size={smallest}" if smallest < min_size and M * smallest <= N else None)
        )
    classes = np.unique(targets[np.concatenate(parts)])
    C = len(classes)
    # per part: (C,) samples of each class
    n_pc = [np.bincount(np.searchsorted(classes, targets[p]), minlength=C) for p in parts]
    best = -1
    for _ in range(max_retries):
        props = _dirichlet_proportions(rng, alpha, C, M)
        counts = [_split_counts(props, n) for n in n_pc]
        sizes = np.stack([c.sum(axis=0) for c in counts])  # (P, M)
        total = sizes.sum(axis=0)
        ok = (total >= need) & plan.viable(sizes)
        best = max(best, int(total.min()))
        if ok.all():
            break
    else:
        raise PartitionError(
            f"dirichlet partition failed: no draw out of max_retries={max_retries} gave every "
            f"one of M={M} clients at least min_size={min_size} samples (effective minimum "
            f"{need}{', plus >= 1 official-train and >= 1 official-test sample' if plan.official else ''}) "
            f"with alpha={alpha} (N={N} samples, {C} classes; best draw's smallest client had "
            f"{best}); "
            + _fixes(f"partition.alpha > {alpha} (more even client sizes)", f"num_clients < {M}",
                     f"partition.min_size={smallest}" if smallest < min_size else None,
                     f"partition.max_retries > {max_retries}")
        )
    owner = np.full(len(targets), -1, dtype=np.int64)
    for part, cnt in zip(parts, counts):
        srt = _sorted_by_label(part, targets, rng)
        owner[srt] = np.repeat(np.tile(np.arange(M), C), cnt.ravel())
    return owner, M


def _label_holders(u: np.ndarray, M: int, s: int, rng: np.random.Generator) -> np.ndarray:
    """(M, s) distinct labels per client, label j used exactly u[j] times (sum u = M*s, u <= M).

    Client by client: labels whose remaining count equals the number of remaining clients are
    forced (they must appear in every remaining client), the rest are drawn without
    replacement proportionally to their remaining counts. Invariant ``remaining <= clients
    left`` keeps the draw always completable. Rows are shuffled at the end.
    """
    remaining = u.astype(np.int64).copy()
    rows = np.empty((M, s), dtype=np.int64)
    for i in range(M):
        left = M - i
        forced = np.flatnonzero(remaining == left)
        k = s - len(forced)
        if k > 0:
            cand = np.flatnonzero((remaining > 0) & (remaining < left))
            w = remaining[cand].astype(np.float64)
            pick = rng.choice(cand, size=k, replace=False, p=w / w.sum())
            chosen = np.concatenate([forced, pick])
        else:
            chosen = forced
        remaining[chosen] -= 1
        rows[i] = chosen
    return rows[rng.permutation(M)]


def partition_pathological(
    targets: np.ndarray,
    num_clients: int | None,
    cfg: Mapping[str, Any],
    rng: np.random.Generator,
    parts: list[np.ndarray],
    groups: np.ndarray | None = None,
    plan: "_Plan | None" = None,
) -> tuple[np.ndarray, int]:
    """Pathological label partition (McMahan et al., 2017 shards), made exact: every client
    holds exactly ``classes_per_client`` distinct labels.

    The M*s label slots (s = classes_per_client) are spread so each present class is held by
    ``q`` or ``q + 1`` clients (extra holders to the largest classes); label sets are random
    (see module doc); each class's shuffled samples are split evenly among its holders, the
    ``n % u`` leftovers one each to the currently smallest holders. With ``keep_official_test``
    the same holders split the official-train and official-test samples separately.

    Args:
        targets: (N,) int64 labels.
        parts: list of (n_p,) int64 sample indices (one part or official train/test).
        cfg: key ``classes_per_client`` (default 2).
    Returns:
        ``(owner, M)``: (N,) int64 client per sample, ``-1`` for samples of unused classes
        (only when ``M*s`` < number of classes), and M.
    Raises:
        PartitionError: ``classes_per_client`` < 1 or > number of classes present; a class
            with fewer (official-train) samples than clients holding it.
    """
    M = _require_clients(num_clients)
    s = cfg.get("classes_per_client", 2)
    s = 2 if s is None else s
    if int(s) != s:
        raise PartitionError(f"classes_per_client must be an integer, got {s}")
    s = int(s)
    classes = np.unique(targets[np.concatenate(parts)])
    K = len(classes)
    if not 1 <= s <= K:
        raise PartitionError(
            f"pathological partition: classes_per_client={s} must be between 1 and the "
            f"number of classes present ({K})"
        )
    n_pc = [np.bincount(np.searchsorted(classes, targets[p]), minlength=K) for p in parts]
    n_ref = n_pc[0]  # sizes that must cover the holders: all samples, or official-train
    q, r = divmod(M * s, K)
    order = np.lexsort((rng.random(K), -n_ref))  # largest classes first, ties at random
    u = np.full(K, q, dtype=np.int64)
    u[order[:r]] += 1
    short = np.flatnonzero(u > n_ref)
    if len(short):
        j = short[0]
        raise PartitionError(
            f"pathological partition: class {int(classes[j])} has {int(n_ref[j])} "
            f"{'official-train ' if plan.official else ''}samples but would be shared by {int(u[j])} "
            f"clients (M={M}, classes_per_client={s}, {K} classes); use fewer clients or a "
            f"smaller classes_per_client"
        )
    rows = _label_holders(u, M, s, rng)
    lab = rows.ravel()
    cli = np.repeat(np.arange(M), s)
    by_label = np.argsort(lab, kind="stable")
    holders = np.split(cli[by_label], np.cumsum(u)[:-1])  # holders[j]: ascending client ids
    owner = np.full(len(targets), -1, dtype=np.int64)
    for part, n in zip(parts, n_pc):
        totals = np.zeros(M, dtype=np.int64)
        sizes = [None] * K
        for j in rng.permutation(K):
            h = holders[j]
            if len(h) == 0:
                continue
            base, rem = divmod(int(n[j]), len(h))
            sz = np.full(len(h), base, dtype=np.int64)
            if rem:
                prio = np.lexsort((rng.random(len(h)), totals[h]))
                sz[prio[:rem]] += 1
            totals[h] += sz
            sizes[j] = sz
        segs = [np.repeat(holders[j], sizes[j]) if len(holders[j]) else np.full(n[j], -1)
                for j in range(K)]
        srt = _sorted_by_label(part, targets, rng)
        owner[srt] = np.concatenate(segs).astype(np.int64) if segs else owner[srt]
    return owner, M


def partition_natural(
    targets: np.ndarray,
    num_clients: int | None,
    cfg: Mapping[str, Any],
    rng: np.random.Generator,
    parts: list[np.ndarray],
    groups: np.ndarray | None = None,
    plan: "_Plan | None" = None,
) -> tuple[np.ndarray, int]:
    """Natural partition (LEAF, Caldas et al., 2018): one client per group id.

    ``num_clients`` None: every group is a client, sorted group ids mapping to clients
    ``0, 1, ...``. An integer is a cap: with G > num_clients groups, ``cfg.client_sample``
    picks the groups that become clients, ``"first"`` (default; the first num_clients in
    sorted id order) or ``"random"`` (a uniform sample without replacement drawn from ``rng``);
    the picked groups map to clients in sorted id order and the others' samples stay
    unassigned.

    Args:
        targets: (N,) int64 labels (only the size is used).
        num_clients: None (every group) or an integer in [1, G].
        cfg: ``client_sample`` (``"first"`` | ``"random"``, default ``"first"``).
        rng: the partition's assignment stream (used by ``"random"`` only).
        groups: (N,) int64 group id per sample.
    Returns:
        ``(owner, M)``: (N,) int64 client per sample (``-1`` for unused groups) and M.
    Raises:
        PartitionError: no groups (the dataset has no natural partition); num_clients not None
            and not an integer >= 1; more clients requested than groups exist; an unknown
            ``client_sample``.
    """
    if groups is None:
        raise PartitionError(
            "the natural partition needs per-sample groups (writer/speaker/centre ids), but "
            "this dataset has no natural partition; use partition=iid, dirichlet or pathological"
        )
    ids, rank = np.unique(groups, return_inverse=True)
    rank = rank.reshape(-1).astype(np.int64)
    G = len(ids)
    if num_clients is None:
        return rank, G
    if isinstance(num_clients, (bool, np.bool_)) or int(num_clients) != num_clients or int(num_clients) < 1:
        raise PartitionError(
            f"natural partition: num_clients={num_clients!r}; use num_clients=null for every group "
            f"(writer/centre; {G} here) or an integer >= 1 to cap the number of clients"
        )
    M = int(num_clients)
    if M > G:
        raise PartitionError(
            f"natural partition: num_clients={M} but the dataset has only {G} groups (writers/centres); "
            f"use num_clients=null for all {G}, or num_clients <= {G}"
        )
    how = str(cfg.get("client_sample", None) or "first")
    if how == "first":
        chosen = np.arange(M)
    elif how == "random":
        chosen = np.sort(rng.choice(G, size=M, replace=False))
    else:
        raise PartitionError(f"partition.client_sample={how!r}; allowed: first, random")
    client_of_rank = np.full(G, -1, dtype=np.int64)
    client_of_rank[chosen] = np.arange(M)
    return client_of_rank[rank], M


def client_groups(num_clients: int, groups: int) -> np.ndarray:
    """(M,) int64 group of each client: contiguous blocks of sizes floor or ceil of M / G
    (clients 0..M/G-1 in group 0, ...), so groups differ in size by at most one client."""
    return np.concatenate([np.full(len(b), g, dtype=np.int64)
                           for g, b in enumerate(np.array_split(np.arange(num_clients), groups))])


def partition_clustered(
    targets: np.ndarray,
    num_clients: int | None,
    cfg: Mapping[str, Any],
    rng: np.random.Generator,
    parts: list[np.ndarray],
    groups: np.ndarray | None = None,
    plan: "_Plan | None" = None,
) -> tuple[np.ndarray, int, np.ndarray]:
    """Clients in G known groups (``partition=clustered``; IFCA's rotated-MNIST construction).

    Client i belongs to group ``client_groups(M, G)[i]``; the clients of group g split the
    samples of group g (``groups == g``, made by :func:`fedfew.data.groups.make_groups`, which
    also applies each group's transform) with the scheme ``cfg.within`` (iid, dirichlet or
    pathological, with that scheme's keys). Each sample goes to a client of its own group.

    Args:
        targets: (N,) int64 labels (after the groups' label permutations).
        groups: (N,) int64 group of each sample, values 0..G-1.
        cfg: ``groups`` (G), ``within`` (default iid) and the within-scheme's keys.
    Returns:
        ``(owner, M, client_group)``: (N,) client per sample, M, and (M,) group per client.
    Raises:
        PartitionError: no sample groups, G > M, an unknown ``within`` scheme, or the within
            scheme's own errors (message prefixed with the group).
    """
    M = _require_clients(num_clients)
    if groups is None:
        raise PartitionError("partition=clustered needs each sample's group (built by fedfew.data.groups.make_groups)")
    G = int(cfg.get("groups", 0) or 0)
    if not 1 <= G <= M:
        raise PartitionError(f"partition.groups={G} must be between 1 and num_clients={M}")
    within = str(cfg.get("within", "iid"))
    if within not in ("iid", "dirichlet", "pathological"):
        raise PartitionError(f"partition.within={within!r}; allowed: iid, dirichlet, pathological")
    scheme = PARTITIONS[within]
    client_group = client_groups(M, G)
    owner = np.full(len(targets), -1, dtype=np.int64)
    for g in range(G):
        members = np.flatnonzero(client_group == g)
        in_group = [p[groups[p] == g] for p in parts]
        try:
            sub, _ = scheme(targets, len(members), cfg, rng, in_group, None, plan)
        except PartitionError as err:
            raise PartitionError(f"partition=clustered, group {g} ({len(members)} clients, "
                                 f"{sum(len(p) for p in in_group)} samples): {err}") from err
        mine = np.concatenate(in_group)
        owner[mine] = np.where(sub[mine] >= 0, members[np.maximum(sub[mine], 0)], -1)
    return owner, M, client_group


PARTITIONS: dict[str, Callable[..., tuple[np.ndarray, int]]] = {
    "iid": partition_iid,
    "dirichlet": partition_dirichlet,
    "pathological": partition_pathological,
    "natural": partition_natural,
    "clustered": partition_clustered,
}


def _require_clients(num_clients: Any) -> int:
    if num_clients is None or int(num_clients) != num_clients or int(num_clients) < 1:
        raise PartitionError(f"num_clients must be a positive integer, got {num_clients!r}")
    return int(num_clients)


# --------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------
def partition_clients(
    targets: np.ndarray,
    num_clients: int,
    cfg: Mapping[str, Any],
    seed: int,
    groups: np.ndarray | None = None,
    official_test: np.ndarray | None = None,
) -> list[ClientSplit]:
    """Partition N samples into M clients, each with sorted train/test/val index sets.

    Args:
        targets: (N,) integer labels (numpy array or CPU tensor), values >= 0.
        num_clients: M >= 1 (``natural``: None means one client per group, an integer caps M).
        cfg: mapping / DictConfig with ``name`` (a key of :data:`PARTITIONS`) and the keys
            ``alpha``, ``min_size``, ``max_retries`` (dirichlet), ``classes_per_client``
            (pathological), ``test_fraction`` (default 0.25), ``val_fraction`` (default 0.0,
            a fraction of the client's train part), ``keep_official_test`` (default false).
        seed: dedicated partition seed (int >= 0); same seed -> identical partition.
        groups: (N,) natural group id per sample (required by ``natural``), or the data group of
            each sample (required by ``clustered``).
        official_test: (N,) bool, True for the dataset's official test samples.

    Returns:
        M :class:`ClientSplit` (``clients[i].id == i``); ``train``/``test``/``val`` are int64
        arrays sorted ascending, pairwise disjoint, disjoint across clients.

    Split rule (without official test split): a client with n samples gets
    ``clamp(round_half_up(test_fraction * n), 1, n - 1)`` test samples, stratified by label
    with the largest-remainder rule (each class of k samples contributes floor or ceil of
    ``test_fraction * k``; a 40/40 client with 0.25 gets exactly 10/10). If ``val_fraction > 0``
    the same rule takes ``clamp(round_half_up(val_fraction * n_train), 1, n_train - 1)``
    validation samples out of the train part.

    Sources: iid and pathological -- McMahan et al., 2017 (AISTATS); dirichlet -- Hsu, Qi &
    Brown, 2019 (arXiv:1909.06335); natural -- Caldas et al., 2018 (LEAF, arXiv:1812.01097).
    The stratified per-client split is the usual PFL protocol (e.g. PFLlib, FedRep):
    every client is evaluated on held-out samples of its own distribution.

    Raises:
        PartitionError: unknown scheme (lists the names); invalid arguments; the scheme's
            own errors (see each ``partition_*``); a client that cannot get >= 1 train and
            >= 1 test sample (and >= 1 val sample when ``val_fraction > 0``) -- the message
            names the client, its sizes and what to change.
    """
    name = cfg.get("name", None)
    if name not in PARTITIONS:
        raise PartitionError(
            f"unknown partition {name!r}; available: {', '.join(sorted(PARTITIONS))} "
            f"(set `partition=<one of these>`)"
        )
    targets = _as_numpy(targets)
    if targets.ndim != 1:
        raise PartitionError(f"targets must be 1-D, got shape {targets.shape}")
    if len(targets) and not np.issubdtype(targets.dtype, np.integer):
        raise PartitionError(f"targets must be integer labels, got dtype {targets.dtype}")
    targets = targets.astype(np.int64, copy=False)
    N = len(targets)
    if N and targets.min() < 0:
        raise PartitionError("targets must be non-negative class indices")
    if groups is not None:
        groups = _as_numpy(groups).reshape(-1)
        if len(groups) != N:
            raise PartitionError(f"groups has length {len(groups)}, expected {N}")
    if official_test is not None:
        official_test = _as_numpy(official_test).reshape(-1).astype(bool)
        if len(official_test) != N:
            raise PartitionError(f"official_test has length {len(official_test)}, expected {N}")
    if isinstance(seed, (bool, np.bool_)) or int(seed) != seed or int(seed) < 0:
        raise PartitionError(f"partition seed must be a non-negative integer, got {seed!r}")

    keep = bool(_get(cfg, "keep_official_test", False))
    if name == "natural":
        official = official_test is not None
    else:
        official = keep and official_test is not None
        if keep and official_test is None:
            warnings.warn(
                "partition.keep_official_test=true but the dataset has no official test "
                "split; using test_fraction instead",
                UserWarning,
                stacklevel=2,
            )
    plan = _Plan(cfg, official)
    assign_rng, split_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(int(seed)).spawn(2))

    all_idx = np.arange(N, dtype=np.int64)
    parts = [all_idx[~official_test], all_idx[official_test]] if official else [all_idx]
    if N == 0:
        raise PartitionError("cannot partition an empty dataset")
    owner, M, *rest = PARTITIONS[name](targets, num_clients, cfg, assign_rng, parts, groups, plan)
    client_group = rest[0] if rest else None  # clustered: the true group of each client

    # ---- per-client split: 0 train, 1 test, 2 val ----------------------------------
    assigned = np.flatnonzero(owner >= 0)
    own = owner[assigned]
    split = np.zeros(N, dtype=np.int64)
    if official:
        split[assigned] = official_test[assigned]
        sizes = np.stack([np.bincount(own[~official_test[assigned]], minlength=M),
                          np.bincount(own[official_test[assigned]], minlength=M)])
    else:
        sizes = np.bincount(own, minlength=M)[None]
    _check_viable(plan, sizes, name, M)
    if not official:
        split[assigned[_stratified_take(own, targets[assigned], M, plan.test_fraction, split_rng)]] = 1
    if plan.val_fraction > 0:
        tr = assigned[split[assigned] == 0]
        split[tr[_stratified_take(owner[tr], targets[tr], M, plan.val_fraction, split_rng)]] = 2

    # ---- assemble sorted index arrays ------------------------------------------------
    key = own * 3 + split[assigned]
    order = np.argsort(key, kind="stable")  # assigned is ascending -> indices stay sorted
    pieces = np.split(assigned[order], np.cumsum(np.bincount(key, minlength=3 * M))[:-1])
    return [ClientSplit(id=i, train=pieces[3 * i], test=pieces[3 * i + 1], val=pieces[3 * i + 2],
                        group=None if client_group is None else int(client_group[i]))
            for i in range(M)]


def _fixes(*options: str | None) -> str:
    """``"fix: a, b or c"`` from the options that apply (None: left out); every partition error
    ends with the changes that can make it succeed, named as config overrides."""
    kept = [o for o in options if o]
    if not kept:
        return "fix: use a larger dataset"
    return "fix: " + (kept[0] if len(kept) == 1 else ", ".join(kept[:-1]) + " or " + kept[-1])


def _check_viable(plan: _Plan, sizes: np.ndarray, name: str, M: int) -> None:
    bad = np.flatnonzero(~plan.viable(sizes))
    if not len(bad):
        return
    i = int(bad[0])
    need = "1 train and 1 test sample" + (" plus 1 validation sample" if plan.val_fraction > 0 else "")
    if plan.official:
        got = f"{int(sizes[0, i])} official-train and {int(sizes[1, i])} official-test samples"
    else:
        got = f"{int(sizes[0, i])} sample(s) (test_fraction={plan.test_fraction}, val_fraction={plan.val_fraction})"
    more = f" ({len(bad)} clients fail, first ones: {bad[:10].tolist()})" if len(bad) > 1 else ""
    # fewer clients leave more samples to each; dropping the validation split helps a client
    # with >= 2 samples (then 1 train + 1 test always fit); nothing else can
    total = int(sizes.sum())
    fewer = f"num_clients < {M}" + (f" (at most {total // plan.min_viable()} can get {plan.min_viable()} samples each)"
                                    if not plan.official else "")
    no_val = (plan.val_fraction > 0 and not plan.official and bool((sizes[0, bad] >= 2).any()))
    raise PartitionError(
        f"{name} partition: client {i} has {got}; every client needs at least {need}{more}; "
        + _fixes(fewer, "partition.val_fraction=0" if no_val else None)
    )


def partition_hash(clients: list[ClientSplit]) -> str:
    """Stable sha256 hex digest of all client index sets.

    Hashes, in client order, each client's id and its train, test and val arrays (length then
    little-endian int64 values), so it is order-sensitive and platform-independent.

    Args:
        clients: list of :class:`ClientSplit`.
    Returns:
        64-character hex string.
    """
    h = hashlib.sha256(b"fedfew-partition-v1")
    for c in clients:
        h.update(np.int64(c.id).astype("<i8").tobytes())
        for arr in (c.train, c.test, c.val):
            a = np.ascontiguousarray(np.asarray(arr, dtype="<i8"))
            h.update(np.int64(len(a)).astype("<i8").tobytes())
            h.update(a.tobytes())
    return h.hexdigest()


def partition_summary(clients: list[ClientSplit], targets: np.ndarray, num_classes: int) -> dict:
    """JSON-able description of a partition.

    Args:
        clients: the M client splits.
        targets: (N,) integer labels of the pooled dataset.
        num_classes: number of classes (length of every ``label_counts`` list).
    Returns:
        ``{"num_clients", "num_classes", "clients": [{"id", "n_train", "n_test", "n_val",
        "label_counts"}, ...], "totals": {"n_samples", "n_assigned", "n_unassigned",
        "n_train", "n_test", "n_val", "label_counts"}}`` with plain ints. ``label_counts``
        counts all of a client's samples (train + test, and val, which is carved out of the
        train part).
    Raises:
        PartitionError: a label outside ``[0, num_classes)``.
    """
    targets = _as_numpy(targets).reshape(-1).astype(np.int64)
    if len(targets) and (targets.min() < 0 or targets.max() >= num_classes):
        raise PartitionError(f"targets outside [0, {num_classes})")
    out, total = [], np.zeros(num_classes, dtype=np.int64)
    nt = ne = nv = 0
    for c in clients:
        idx = np.concatenate([c.train, c.test, c.val]).astype(np.int64)
        counts = np.bincount(targets[idx], minlength=num_classes)
        total += counts
        nt, ne, nv = nt + len(c.train), ne + len(c.test), nv + len(c.val)
        out.append({"id": int(c.id), "n_train": int(len(c.train)), "n_test": int(len(c.test)),
                    "n_val": int(len(c.val)), "label_counts": [int(x) for x in counts]})
    assigned = nt + ne + nv
    return {
        "num_clients": len(clients),
        "num_classes": int(num_classes),
        "clients": out,
        "totals": {"n_samples": int(len(targets)), "n_assigned": int(assigned),
                   "n_unassigned": int(len(targets) - assigned), "n_train": int(nt),
                   "n_test": int(ne), "n_val": int(nv), "label_counts": [int(x) for x in total]},
    }


def partition_scheme(partition: Mapping[str, Any]) -> str:
    """The partition scheme with the keys that shaped it, e.g. ``dirichlet (alpha=0.5)``,
    ``pathological (classes_per_client=2)`` or ``clustered (4 groups, rotate, split; within iid)``.

    Args:
        partition: the ``partition`` config group (a dict or DictConfig).
    """
    name = partition.get("name")
    label_keys = {"dirichlet": ("alpha",), "pathological": ("classes_per_client",)}
    if name == "clustered":
        within = partition.get("within", "iid")
        inner = ", ".join(f"{k}={partition[k]}" for k in label_keys.get(within, ()) if partition.get(k) is not None)
        detail = (f"{partition.get('groups')} groups, {partition.get('group_transform')}, "
                  f"{partition.get('group_data')}; within {within}{f' ({inner})' if inner else ''}")
    else:
        detail = ", ".join(f"{k}={partition[k]}" for k in label_keys.get(name, ()) if partition.get(k) is not None)
    return f"{name}{f' ({detail})' if detail else ''}"
