"""Encode Images decodes on threads a few images ahead: results in order, memory bounded, errors where they
happened, and a dataset's encoder calls and problems those of a one-thread run."""

import threading
import time

import numpy as np
import pytest
from PIL import Image

from trainer.data import prefetch
from trainer.data.dataset import Dataset, DataSettings


def test_results_come_in_the_jobs_order_and_no_more_than_threads_are_ahead():
    running, most, lock = [0], [0], threading.Lock()

    def work(job):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.002 * (job % 3))  # later jobs may finish first
        with lock:
            running[0] -= 1
        return job * job

    taken = []
    for result in prefetch.in_order(range(40), work, threads=3):
        taken.append(result)
        time.sleep(0.001)  # a slow consumer: work must not pile up beyond 3
    assert taken == [j * j for j in range(40)] and 1 < most[0] <= 3
    assert list(prefetch.in_order(range(5), lambda j: -j, threads=1)) == [0, -1, -2, -3, -4]


def test_an_error_is_raised_where_its_result_would_be_and_the_rest_is_dropped():
    started = []

    def work(job):
        started.append(job)
        if job == 2:
            raise ValueError("job 2")
        time.sleep(0.01)
        return job

    seen = []
    with pytest.raises(ValueError, match="job 2"):
        for result in prefetch.in_order(range(100), work, threads=2):
            seen.append(result)
    assert seen == [0, 1] and len(started) < 10  # jobs past the bound were never submitted


def test_workers_follow_the_cores_up_to_the_cap(monkeypatch):
    monkeypatch.setattr(prefetch.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert prefetch.workers() == prefetch.MAX_WORKERS
    monkeypatch.setattr(prefetch.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert prefetch.workers() == 1


def photos(root, count=7):
    rng = np.random.default_rng(0)
    root.mkdir()
    for i in range(count):
        size = [(300, 200), (200, 300), (256, 256)][i % 3]
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(root / f"{i}.png")
        (root / f"{i}.txt").write_text(f"photo {i}", encoding="utf-8")
    return root


@pytest.mark.parametrize("threads", [2, 4])
def test_encode_images_gives_the_encoder_what_one_thread_gives(tmp_path, monkeypatch, threads):
    """Same batches in the same order, bit for bit; the image broken after the scan named once, as before."""
    settings = DataSettings(resolutions=(128, 192))

    def run(n, name):
        root, calls = photos(tmp_path / name), []

        def vae(pixels):
            calls.append(pixels.copy())
            b, h, w, _ = pixels.shape
            return pixels.reshape(b, h // 8, 8, w // 8, 8, 3).mean(axis=(2, 4)).transpose(0, 3, 1, 2)

        monkeypatch.setattr(prefetch, "workers", lambda: n)
        ds = Dataset.load(root, settings)
        (root / "3.png").write_bytes((root / "3.png").read_bytes()[:100])  # broken after the scan
        ds = ds.encode_images(vae, "vae-1", batch_size=2)
        return calls, [(p.file, p.code) for p in ds.encode_problems], ds.failed_items

    one = run(1, "one")
    many = run(threads, "many")
    assert len(one[0]) == len(many[0]) > 3 and all(np.array_equal(a, b) for a, b in zip(one[0], many[0]))
    assert one[1] == many[1] == [("3.png", one[1][0][1])] and one[2] == many[2] == frozenset({3})
