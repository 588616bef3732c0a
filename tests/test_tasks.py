"""A task's last cleanup survives the cancels that :func:`slogate.tasks.cancel_and_wait` repeats."""

from __future__ import annotations

import asyncio

import pytest

from slogate.tasks import cancel_and_wait, despite_cancels


async def test_a_cleanup_ends_despite_repeated_cancels_and_the_cancel_still_ends_the_task() -> None:
    done: list[str] = []

    async def cleanup() -> None:
        for _ in range(10):  # past several of cancel_and_wait's rounds
            await asyncio.sleep(0.01)
        done.append("cleaned up")

    async def run() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await despite_cancels(cleanup())
            done.append("after the cleanup")

    task = asyncio.create_task(run())
    await asyncio.sleep(0)
    await cancel_and_wait([task], every_s=0.005)
    assert task.cancelled()
    assert done == ["cleaned up"], "the cleanup ran to its end, and the cancel ended the task after it"


async def test_a_cleanup_without_cancels_returns_as_it_ends() -> None:
    async def cleanup() -> None:
        await asyncio.sleep(0)

    await despite_cancels(cleanup())


async def test_a_cleanup_that_is_itself_cancelled_ends_it() -> None:
    """The loop closing cancels every task, the cleanup's own too: waiting on would never end."""
    started = asyncio.Event()

    async def cleanup() -> None:
        started.set()
        await asyncio.sleep(60)

    inner = asyncio.ensure_future(cleanup())
    outer = asyncio.create_task(despite_cancels(inner))
    await started.wait()
    inner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer


@pytest.mark.parametrize("cancel_first", [True, False])
async def test_a_cleanup_that_fails_as_the_cancel_lands_raises_its_failure(cancel_first: bool) -> None:
    """A cancel landing in the same turn as the cleanup's failure once read as the cleanup being
    cancelled itself: the failure was dropped and only the cancel came out."""
    fail = asyncio.Event()

    async def cleanup() -> None:
        await fail.wait()
        raise RuntimeError("cleanup failed")

    outer = asyncio.create_task(despite_cancels(cleanup()))
    await asyncio.sleep(0)
    if cancel_first:
        outer.cancel()
        fail.set()
    else:
        fail.set()
        outer.cancel()
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await outer


async def test_a_cleanup_that_fails_after_a_cancel_raises_its_failure() -> None:
    async def cleanup() -> None:
        await asyncio.sleep(0.02)
        raise RuntimeError("cleanup failed")

    async def run() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await despite_cancels(cleanup())

    task = asyncio.create_task(run())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await task
