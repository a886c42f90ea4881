"""Device assignment (``serving.config.devices``) over simulated device lists: which GPUs the server sees, how
``load_on_devices`` and ``tensor_parallel_degree`` cut them into worker groups, and the exact
``CUDA_VISIBLE_DEVICES`` each worker process gets from the pool."""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

import pytest

from rollcore.errors import ConfigError
from serving.config.devices import DevicePlan, DeviceSlots, chosen_devices, plan_devices, visible_devices
from serving.ipc.messages import Init
from serving.worker.pool import WorkerPool

SMI_4 = "\n".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i}000)" for i in range(4)) + "\n"


def smi(output: str) -> Any:
    calls: list[list[str]] = []

    def run(cmd: list[str]) -> str:
        calls.append(cmd)
        return output

    run.calls = calls  # type: ignore[attr-defined]
    return run


def test_visible_devices_from_nvidia_smi() -> None:
    run = smi(SMI_4 + "  MIG 1g.18gb Device 0: (UUID: MIG-x)\n")
    assert visible_devices({}, run) == ("0", "1", "2", "3")
    assert run.calls == [["nvidia-smi", "-L"]]


def test_cuda_visible_devices_wins_and_is_never_probed() -> None:
    run = smi(SMI_4)
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "2,3"}, run) == ("2", "3")
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}, run) == ()
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "-1"}, run) == ()
    assert run.calls == []


def test_no_gpu_when_nvidia_smi_fails() -> None:
    def broken(cmd: list[str]) -> str:
        raise subprocess.CalledProcessError(9, cmd)

    assert visible_devices({}, broken) == ()


@pytest.mark.parametrize(("spec", "visible", "want"), [
    ("*", ("0", "1", "2", "3"), ("0", "1", "2", "3")),
    ("", ("0", "1"), ("0", "1")),
    ("0;2", ("0", "1", "2", "3"), ("0", "2")),
    ("1", ("4", "5"), ("5",)),  # indices into the visible list: CUDA_VISIBLE_DEVICES=4,5 and id 1 is GPU 5
    ("*", (), ()),
])
def test_load_on_devices(spec: str, visible: tuple[str, ...], want: tuple[str, ...]) -> None:
    assert chosen_devices(spec, visible) == want


def test_load_on_devices_naming_an_invisible_device_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"^load_on_devices = '0;7': device '7' is not one of the 4 visible"):
        chosen_devices("0;7", ("0", "1", "2", "3"))
    with pytest.raises(ConfigError, match="no GPU is visible to this server"):
        chosen_devices("0", ())


@pytest.mark.parametrize(("visible", "spec", "tp", "groups"), [
    (("0", "1", "2", "3"), "*", 1, (("0",), ("1",), ("2",), ("3",))),
    (("0", "1", "2", "3"), "*", 2, (("0", "1"), ("2", "3"))),
    (("0", "1", "2", "3"), "*", 4, (("0", "1", "2", "3"),)),
    (("0", "1", "2", "3", "4", "5", "6", "7"), "*", 3, (("0", "1", "2"), ("3", "4", "5"))),  # 6, 7 stay idle
    (("0", "1", "2", "3"), "1;3", 2, (("1", "3"),)),
    ((), "*", 4, ()),  # CPU host: CPU workers, TP ranks as processes
])
def test_groups(visible: tuple[str, ...], spec: str, tp: int, groups: tuple[tuple[str, ...], ...]) -> None:
    assert plan_devices(visible, spec, tp).groups == groups


def test_too_few_devices_for_one_group() -> None:
    with pytest.raises(ConfigError, match=r"^tensor_parallel_degree = 4 needs 4 devices; load_on_devices = '0;1' "
                                          r"gives 2 \(0,1\)$"):
        plan_devices(("0", "1", "2", "3"), "0;1", 4)


def test_workers_are_capped_by_groups_on_gpus_only() -> None:
    assert DevicePlan((("0",), ("1",))).max_workers(5) == 2
    assert DevicePlan().max_workers(5) == 5


def test_slots_hand_out_free_groups_and_take_them_back() -> None:
    slots = DeviceSlots(DevicePlan((("0", "1"), ("2", "3"))))
    assert slots.take(1) == ("0", "1")
    assert slots.take(2) == ("2", "3")
    with pytest.raises(RuntimeError, match="no free device group for worker 3: all 2 are held"):
        slots.take(3)
    slots.release(1)
    assert slots.take(3) == ("0", "1")
    assert slots.of(3) == ("0", "1") and slots.of(1) is None


class _Batcher:
    def worker_ready(self, worker: object) -> None: ...
    def worker_lost(self, worker: object) -> None: ...
    def on_message(self, worker: object, msg: object) -> None: ...
    def worker_load(self, worker: object) -> int:
        return 0
    def retire(self, worker: object) -> None: ...


def _environ(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")  # noqa: SIM115
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.parametrize(("plan", "workers", "want"), [
    (DevicePlan((("0",), ("1",), ("2",), ("3",))), 4, [("0", 0), ("1", 0), ("2", 0), ("3", 0)]),
    (DevicePlan((("0", "1"), ("2", "3"))), 4, [("0,1", 0), ("2,3", 0)]),  # capped at two groups
    (DevicePlan(), 2, [("", -1), ("", -1)]),
])
def test_pool_starts_each_worker_process_on_its_own_devices(tmp_path: object, plan: DevicePlan, workers: int,
                                                            want: list[tuple[str, int]]) -> None:
    """Real worker processes (the echo handler, which never touches a device): each one's environment, read
    from /proc, holds exactly its group; a worker that exits hands its group to its replacement."""
    init = Init(model_name="m", model_dir=str(tmp_path), entry_point="echo", properties={})

    async def scenario() -> None:
        pool = WorkerPool("m", init, _Batcher(), workers, 60.0, on_failed=lambda reason: None,
                          env={"CUDA_VISIBLE_DEVICES": "0,1,2,3", "PATH": "/usr/bin:/bin"}, devices=plan)
        try:
            assert await pool.start()
            while pool.num_starting:  # start() returns with the first ready worker
                await asyncio.sleep(0.05)
            got = sorted((_environ(h.pid)["CUDA_VISIBLE_DEVICES"], h.init.device_id)  # type: ignore[arg-type]
                         for h in pool.workers.values())
            assert got == want
            assert sorted(w["devices"] for w in pool.describe()) == sorted(
                [f"gpu{d}" for d in cvd.split(",")] if cvd else ["cpu"] for cvd, _ in want)
            if plan.on_gpu:
                first = min(pool.workers)
                group = pool.devices.of(first)
                await pool.workers[first].stop()
                while first in pool.workers:  # the exit is reported; the pool restarts a worker on that group
                    await asyncio.sleep(0.05)
                while len(pool.workers) < len(want):
                    await asyncio.sleep(0.05)
                newest = max(pool.workers)
                assert pool.devices.of(newest) == group
                # type: ignore[arg-type]
                assert _environ(pool.workers[newest].pid)["CUDA_VISIBLE_DEVICES"] == ",".join(group)
        finally:
            await pool.stop()

    asyncio.run(asyncio.wait_for(scenario(), 120))
