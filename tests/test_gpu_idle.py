"""zoffbench/gpu_idle.py: the GPU's idle time and gaps in a profiled step, against intervals counted by hand."""

from types import SimpleNamespace

import pytest
import torch

from zoffbench.gpu_idle import KERNELS, NAME_CHARS, HostCall, busy_by_kernel, idle_gaps, stop_and_read, summary


def test_idle_gaps_are_the_holes_in_the_union_of_the_streams_work_named_by_the_host_calls_around_them():
    busy = [(0.0, 1.0), (0.5, 2.0), (1.2, 1.5), (3.0, 4.0), (4.00005, 5.0)]  # two streams overlap up to 2.0
    host = [HostCall("step", 0.0, 5.0, 1), HostCall("cudaStreamSynchronize", 1.9, 3.05, 1),
            HostCall("launch", 2.5, 2.6, 1), HostCall("copy", 2.2, 2.4, 2), HostCall("later", 3.5, 3.6, 2)]
    idle = idle_gaps(busy, host)
    assert idle["span_s"] == 5.0
    assert idle["gaps"] == 2  # 2.0-3.0 and 4.0-4.00005
    assert idle["idle_s"] == pytest.approx(1.0 + 5e-5)
    [gap] = idle["longest"]  # the 50 us gap is in the total only
    assert gap["at_s"] == 2.0
    assert gap["s"] == pytest.approx(1.0)
    assert [name.split(" (")[0] for name in gap["covered_by"]] == ["cudaStreamSynchronize", "step"]  # innermost first
    assert [name.split(" (")[0] for name in gap["started_in"]] == ["copy", "launch"]  # in the gap, longest first
    assert gap["covered_by"][0] == "cudaStreamSynchronize (1150.00 ms, thread 1)"
    assert idle["idle_by_host_call"] == {"cudaStreamSynchronize": pytest.approx(1.0)}


def test_a_gap_no_host_call_covers_is_said_so():
    idle = idle_gaps([(0.0, 1.0), (1.5, 2.0)], [HostCall("late", 1.2, 1.4, 1)])
    assert idle["idle_by_host_call"] == {"(no host call)": pytest.approx(0.5)}
    assert idle["longest"][0]["covered_by"] == []
    assert idle["longest"][0]["started_in"][0].startswith("late")


def test_a_profile_without_device_activity_reads_as_none():
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    profiler.start()
    torch.ones(64, 64).sum()
    assert stop_and_read(profiler) is None


def test_the_summary_names_each_profiled_run_its_idle_share_and_what_the_host_did():
    idle = idle_gaps([(0.0, 0.010), (0.012, 0.020)], [HostCall("aten::item", 0.009, 0.0125, 1)])
    lines = summary({"runs": [{"name": "zoff", "accumulate": 1, "gpu_idle": idle}, {"name": "deepspeed"}]})
    assert lines[0] == "zoff acc=1: GPU idle 2.0 ms of a 20.0 ms step (1 gaps)"
    assert lines[1] == "  under aten::item: 2.0 ms"
    assert lines[2].startswith("  gap 2.00 ms at 10.0 ms: covered by ['aten::item (3.50 ms, thread 1)']")
    assert len(lines) == 3  # a run without a profile says nothing


def test_the_gpu_time_is_summed_by_kernel_longest_first_with_long_names_cut():
    template = "void at::native::elementwise_kernel<" + "x" * 500
    kernels = [("gemm", 0.004), ("copy", 0.001), ("gemm", 0.003), (template + "A", 0.002), (template + "B", 0.0035)]
    kernels += [(f"tiny{i}", 1e-6) for i in range(KERNELS)]
    busy = busy_by_kernel(kernels)
    assert len(busy) == KERNELS
    assert busy[0] == {"name": "gemm", "s": pytest.approx(0.007), "count": 2}
    assert busy[1] == {"name": template[:NAME_CHARS], "s": pytest.approx(0.0055), "count": 2}  # one name once cut
    assert busy[2] == {"name": "copy", "s": pytest.approx(0.001), "count": 1}
    idle = {**idle_gaps([(0.0, 0.01)], []), "busy_by_kernel": busy}
    lines = summary({"runs": [{"name": "zoff", "accumulate": 1, "gpu_idle": idle}]})
    assert lines[1] == "  busy 7.0 ms in 2 x gemm"


class _Event:
    """What `_read` asks of a profiler's event."""

    def __init__(self, name, start_ms, end_ms, activity, cuda=True):
        self._name, self._start, self._end, self._activity, self._cuda = name, start_ms, end_ms, activity, cuda

    def name(self):
        return self._name

    def start_ns(self):
        return int(self._start * 1e6)

    def end_ns(self):
        return int(self._end * 1e6)

    def activity_type(self):
        return self._activity

    def device_type(self):
        return torch.autograd.DeviceType.CUDA if self._cuda else torch.autograd.DeviceType.CPU

    def start_thread_id(self):
        return 1


class _Profiled:
    """A stopped profiler holding `events`."""

    def __init__(self, events):
        self.profiler = SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events))

    def stop(self):
        pass


def test_gpu_side_annotations_are_neither_busy_time_nor_kernels():
    events = [_Event("Optimizer.step#AdamW.step", 0.0, 10.0, "gpu_user_annotation"),  # spans the idle 2-7.5 ms
              _Event("gemm", 0.0, 2.0, "kernel"), _Event("Memcpy DtoD", 7.5, 9.0, "gpu_memcpy"),
              _Event("Memset", 9.0, 10.0, "gpu_memset"), _Event("cudaStreamSynchronize", 2.0, 8.0, "cuda_runtime",
                                                                  cuda=False)]
    idle = stop_and_read(_Profiled(events))
    assert idle["span_s"] == pytest.approx(0.010)
    assert idle["idle_s"] == pytest.approx(0.0055)
    assert idle["idle_by_host_call"] == {"cudaStreamSynchronize": pytest.approx(0.0055)}
    assert [kernel["name"] for kernel in idle["busy_by_kernel"]] == ["gemm", "Memcpy DtoD", "Memset"]


def test_a_profile_that_cannot_be_read_is_reported_not_raised():
    class Broken:
        def stop(self):
            raise RuntimeError("CUPTI is busy")

    idle = stop_and_read(Broken())
    assert idle == {"error": "RuntimeError: CUPTI is busy"}
    assert summary({"runs": [{"name": "zoff", "gpu_idle": idle}]}) == [
        "zoff: the profile could not be read: RuntimeError: CUPTI is busy"]
