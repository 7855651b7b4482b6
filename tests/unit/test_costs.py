"""kvstore_connector.costs: the prefix worth loading against recomputing it."""

from __future__ import annotations

from kvstore_connector.costs import HOT_LOAD_RATE, worth_loading

from kvstore import wire

M, P, F = wire.TIER_MEMORY, wire.TIER_PERSISTENT, wire.TIER_FLEET
BLOCK = 2 << 20  # bytes of a block (Llama-3.1-8B, 16 tokens)
TOKENS = 16


def pick(tiers: list[int], persistent: float, fleet: float = 1e9, recompute: float = 30_000.0) -> int:
    return worth_loading(bytes(tiers), TOKENS, BLOCK, persistent, fleet, recompute)


def test_a_fast_tier_loads_everything_a_slow_one_nothing() -> None:
    # a block recomputes in 16 / 30000 s = 0.53 ms; 2 MiB load in 0.21 ms at 10 GB/s, 17 ms at 0.12
    assert pick([P] * 8, persistent=10e9) == 8
    assert pick([P] * 8, persistent=0.12e9) == 0
    assert pick([M] * 8, persistent=0.12e9) == 8


def test_the_prefix_that_saves_the_most_time_wins() -> None:
    # memory blocks first, then slow ones: load the memory part, recompute the rest
    assert pick([M, M, M, P, P], persistent=0.12e9) == 3
    # a slow block among fast ones: worth taking while the fast ones after it repay it
    fast_after = [M] * 4 + [P] + [M] * 60
    assert pick(fast_after, persistent=0.5e9) == len(fast_after)
    assert pick([M, P, M], persistent=0.12e9) == 1


def test_unmeasured_rates_count_as_fast_and_zero_turns_the_check_off() -> None:
    assert pick([P, F, P], persistent=0.0, fleet=0.0) == 3  # the first loads measure them
    assert pick([P] * 4, persistent=1.0, recompute=0.0) == 4  # off: every hit loads
    assert worth_loading(bytes([P] * 4), TOKENS, 0, 1.0, 1.0, 30_000.0) == 4  # size unknown: off


def test_memory_hits_lose_only_to_an_implausibly_fast_recompute() -> None:
    recompute_s = TOKENS / 1e9
    assert recompute_s < BLOCK / HOT_LOAD_RATE
    assert pick([M] * 4, persistent=1e9, recompute=1e9) == 0
