"""allocate_options (sparse/site_allocation.py): per-site levels with optional rotations at a
fixed price, against an exhaustive search over every assignment of a small problem (numpy)."""

from __future__ import annotations

import itertools

import numpy as np

from powerinfer_cpp.sparse.site_allocation import allocate_options


def _problem(seed):
    rng = np.random.default_rng(seed)
    lv = np.linspace(0, 0.6, 4)
    units = []
    for _ in range(3):
        sites = [(float(rng.uniform(1, 10)), float(rng.uniform(0.01, 0.2)), float(rng.uniform(1.5, 4)))
                 for _ in range(int(rng.integers(1, 3)))]
        base = [(b * (1 - lv), c * (lv / 0.3) ** p) for b, c, p in sites]
        # a rotation: fixed bytes, every site of the unit at a fraction of its KL
        f = float(rng.uniform(0.05, 0.5))
        rot = [(bv, kv * f) for bv, kv in base]
        units.append([(0.0, base), (float(rng.uniform(0.2, 3.0)), rot)])
    return units


def _all(units):
    for choice in itertools.product(*[[(oi, lvs) for oi, (_, parts) in enumerate(u)
                                        for lvs in itertools.product(*[range(len(p[0])) for p in parts])]
                                       for u in units]):
        b = k = 0.0
        for u, (oi, lvs) in zip(units, choice):
            fixed, parts = u[oi]
            b += fixed + sum(float(p[0][j]) for p, j in zip(parts, lvs))
            k += sum(float(p[1][j]) for p, j in zip(parts, lvs))
        yield b, k


def test_allocate_options_against_every_assignment():
    exact = 0
    for seed in range(6):
        units = _problem(seed)
        dense = sum(float(sum(p[0][0] for p in u[0][1])) for u in units)
        for max_kl in (0.02, 0.1, 0.4):
            b, k, pick = allocate_options(units, max_kl)
            assert k <= max_kl + 1e-12
            # the Lagrangian answer is optimal for the KL it reaches, the greedy fill only lowers
            # the bytes: never more than the best assignment of at most that KL, never less
            # than the best within the budget
            best_at_k = min(bb for bb, kk in _all(units) if kk <= k + 1e-12)
            best = min(bb for bb, kk in _all(units) if kk <= max_kl + 1e-12)
            assert best - 1e-9 <= b <= best_at_k + 1e-9, (seed, max_kl, b, best)
            exact += abs(b - best) < 1e-9
            # no single unit's change fits the remaining budget and saves bytes
            for u, opts in enumerate(units):
                oi, lvs = pick[u]
                cur_b = opts[oi][0] + sum(float(p[0][j]) for p, j in zip(opts[oi][1], lvs))
                cur_k = sum(float(p[1][j]) for p, j in zip(opts[oi][1], lvs))
                for fixed, parts in opts:
                    for js in itertools.product(*[range(len(p[0])) for p in parts]):
                        nb = fixed + sum(float(p[0][j]) for p, j in zip(parts, js))
                        nk = sum(float(p[1][j]) for p, j in zip(parts, js))
                        assert not (nk - cur_k <= max_kl - k - 1e-12 and nb < cur_b - 1e-6)
            # the answer's own accounting
            bb = kk = 0.0
            for u, (oi, lvs) in zip(units, pick):
                fixed, parts = u[oi]
                bb += fixed + sum(float(p[0][j]) for p, j in zip(parts, lvs))
                kk += sum(float(p[1][j]) for p, j in zip(parts, lvs))
            assert abs(bb - b) < 1e-9 and abs(kk - k) < 1e-12
            if max_kl >= 0.1:
                assert b < dense  # a budget that allows sparsity is spent
    assert exact >= 12  # the exhaustive optimum in most of the 18 cases


def test_allocate_options_everything_fits():
    units = _problem(1)
    b, k, pick = allocate_options(units, 1e9)
    assert all(all(j == 3 for j in lvs) for _, lvs in pick)  # every site at its highest level
