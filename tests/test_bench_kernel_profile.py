"""`bench compute --kernel-profile`: kernel groups, what is kept of the profiler's events, the
per-side figures, and the CPU run end to end (NOTE [kernel profile] in
hpcdl/bench/kernel_profile.py)."""

from __future__ import annotations

import json

import pytest

from hpcdl.backend import gpu_available
from hpcdl.bench import compute, kernel_profile
from hpcdl.bench.kernel_profile import GROUPS, Activity, SideProfile, kernel_group, short_name
from hpcdl.nn import kernels

# Names as the profiler gives them: cuDNN, cuBLAS and PyTorch kernels on Hopper, CuPy's and
# hpcdl's own kernels, kineto's memcpy/memset names, and PyTorch's CPU ops off a GPU.
NAMES = [  # (group, name)
    (
        "convolution",
        "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_"
        "tilesize128x128x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_"
        "cudnn",
    ),
    (
        "convolution",
        "sm90_xmma_dgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x256x64",
    ),
    ("convolution", "sm80_xmma_wgrad_implicit_gemm_indexed_bf16bf16_bf16f32_f32_nhwckrsc_nhwc"),
    ("convolution", "void cudnn::winograd_nonfused::winogradForwardData4x4<float, float>(...)"),
    ("convolution", "aten::mkldnn_convolution"),
    ("gemm", "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn"),
    ("gemm", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1"),
    ("gemm", "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>(...)"),
    ("gemm", "aten::addmm"),
    (
        "batchnorm/norm",
        "void cudnn::bn_fw_tr_1C11_singleread_spec_kernel<__nv_bfloat16, float, "
        "float, 512, true, 1, true>(cudnnTensorStruct, __nv_bfloat16 const*, ...)",
    ),
    (
        "batchnorm/norm",
        "void at::native::batch_norm_collect_statistics_channels_last_kernel<at::"
        "native::Var, c10::BFloat16, float, 4>(...)",
    ),
    ("pooling", "hpcdl_maxpool_forward_bf16"),
    (
        "pooling",
        "void at::native::(anonymous namespace)::max_pool_forward_nhwc<c10::BFloat16>(...)",
    ),
    (
        "reduction",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::"
        "native::func_wrapper_t<float, at::native::sum_functor<float, float, "
        "float>::operator()>, ...>>(...)",
    ),
    (
        "reduction",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, "
        "float, float, at::native::(anonymous namespace)::"
        "LogSoftMaxForwardEpilogue>(...)",
    ),
    ("reduction", "cupy_sum"),
    ("elementwise/copy", "cupy_copy__float32_bfloat16"),
    ("elementwise/copy", "cupy_multiply__float32_float32_float32"),
    (
        "elementwise/copy",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_"
        "add<c10::BFloat16>, std::array<char*, 3ul> >(int, ...)",
    ),
    (
        "elementwise/copy",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(...)",
    ),
    (
        "elementwise/copy",
        "void cudnn::ops::nchwToNhwcKernel<__nv_bfloat16, __nv_bfloat16, float, false, true>(...)",
    ),
    ("elementwise/copy", "hpcdl_philox_dropout"),
    ("elementwise/copy", "aten::add_"),
    (
        "optimizer",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::"
        "native::(anonymous namespace)::TensorListMetadata<3>, at::native::"
        "(anonymous namespace)::FusedSgdMathFunctor<float, 3>, ...>(...)",
    ),
    ("optimizer", "hpcdl_fused_sgd_1010"),
    ("memcpy/memset", "Memcpy DtoD (Device -> Device)"),
    ("memcpy/memset", "Memset (Device)"),
    (
        "elementwise/copy",  # "normal_and_transform": no norm
        "void at::native::(anonymous namespace)::distribution_elementwise_grid_"
        "stride_kernel<float, 4, at::native::templates::cuda::normal_and_"
        "transform<...>>(...)",
    ),
    ("other", "a_kernel_nobody_has_named_yet"),
    ("other", "aten::bernoulli_"),
]
NAMES_BY_GROUP = {group: name for group, name in reversed(NAMES)}  # one name each


@pytest.mark.parametrize(("group", "name"), NAMES)
def test_a_kernel_lands_in_its_group_by_name(group, name):
    assert kernel_group(name) == group


def test_every_group_is_reached_by_some_real_name():
    assert {group for group, _ in NAMES} == set(GROUPS)
    assert {group for group, _ in kernel_profile.GROUP_PATTERNS} | {"other"} == set(GROUPS)


def test_a_name_is_cut_to_one_short_line():
    name = "void  at::native::vectorized_elementwise_kernel<4,\n at::native::FillFunctor<float>>"
    assert short_name(name) == (
        "at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"
    )
    long = short_name("x" * 200)
    assert len(long) == kernel_profile.NAME_CHARS and long.endswith("...")


def _device_event(torch, name: str, kind: str, start: float, end: float, cuda: bool = True):
    """One of torch.profiler's own FunctionEvents, as it builds them from kineto's records."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    return FunctionEvent(
        id=0,
        name=name,
        thread=7,
        start_us=start,
        end_us=end,
        device_type=DeviceType.CUDA if cuda else DeviceType.CPU,
        activity_type=kind,
        use_device="cuda",
    )


def test_only_kernels_memcpys_and_memsets_on_the_device_are_kept():
    """A GPU user annotation spans the kernels it holds: summed, it would count them twice.
    CPU ops and the runtime's launch calls are host events, not device time."""
    torch = pytest.importorskip("torch")
    conv = NAMES_BY_GROUP["convolution"]
    events = [
        _device_event(torch, conv, "kernel", 10.0, 40.0),
        _device_event(torch, "Memset (Device)", "gpu_memset", 40.0, 42.0),
        _device_event(torch, "Optimizer.step#SGD.step", "gpu_user_annotation", 0.0, 50.0),
        _device_event(torch, "cudaLaunchKernel", "cuda_runtime", 1.0, 4.0, cuda=False),
        _device_event(torch, "aten::conv2d", "cpu_op", 0.0, 9.0, cuda=False),
    ]
    kept, skipped = kernel_profile.recorded_activities(events, cuda=True)
    assert kept == [
        Activity(conv, "kernel", 30.0),
        Activity("Memset (Device)", "gpu_memset", 2.0),
    ]
    assert skipped == {"gpu_user_annotation": 1}
    cpu_kept, _ = kernel_profile.recorded_activities(events, cuda=False)
    assert [a.name for a in cpu_kept] == ["aten::conv2d"]  # off a GPU: the CPU ops only


def test_the_recording_keeps_the_asked_steps_and_drops_the_one_that_starts_it():
    """The schedule's warm-up step runs with the recorder on (CUPTI starts there) and is not
    kept: two recorded steps of one matmul each list two matmuls, not three."""
    torch = pytest.importorskip("torch")
    a = torch.ones(8, 8)
    ran = []
    rec = kernel_profile.Recorder(torch, "cpu", cuda=False)
    wall_s, prof = rec.record((lambda: ran.append(torch.mm(a, a)), lambda: None), steps=2)
    kept, _ = kernel_profile.recorded_activities(prof.events(), cuda=False)
    assert len(ran) == 3 and wall_s > 0
    assert [x.name for x in kept if x.name == "aten::mm"] == ["aten::mm"] * 2


def test_a_side_reports_per_step_figures_top_kernels_and_groups():
    conv, gemm = NAMES_BY_GROUP["convolution"], NAMES_BY_GROUP["gemm"]
    acts = [Activity(conv, "kernel", 3000.0)] * 4 + [Activity(gemm, "kernel", 1000.0)] * 2
    acts += [Activity("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 500.0)] * 2
    p = SideProfile("hpcdl", "cuda", steps=2, wall_s=0.020, plain_wall_s=0.018,
                    activities=tuple(acts))  # fmt: skip
    d = p.as_json()
    assert d["kernel_ms_per_step"] == 7.5  # (12 + 2 + 1) ms over 2 steps
    assert d["kernels_per_step"] == 3 and d["memops_per_step"] == 1
    assert d["wall_ms_per_step"] == 10.0 and d["plain_wall_ms_per_step"] == 9.0
    assert d["busy"] == 0.75
    assert [k["group"] for k in d["kernels"]] == ["convolution", "gemm", "memcpy/memset"]
    assert d["kernels"][0] == {
        "name": short_name(conv),
        "group": "convolution",
        "calls_per_step": 2.0,
        "ms_per_step": 6.0,
        "share": 0.8,
    }
    assert sum(k["share"] for k in d["kernels"]) == pytest.approx(1.0)
    assert d["groups"] == {"convolution": 6.0, "gemm": 1.0, "memcpy/memset": 0.5}
    assert d["note"] is None and d["distinct_kernels"] == 3


def test_a_side_the_profiler_cannot_see_lists_nothing_and_says_why():
    p = SideProfile("hpcdl", "cpu", steps=1, wall_s=0.02, plain_wall_s=0.02, note="NumPy")
    d = p.as_json()
    assert d["kernels"] == [] and d["groups"] == {} and d["note"] == "NumPy"
    assert d["kernel_ms_per_step"] is None and d["busy"] is None


TINY = ["--device", "cpu", "--model", "cnn", "--batch-size", "4", "--input-shape", "3,16,16"]


def test_on_a_cpu_torch_lists_its_ops_and_hpcdl_says_it_cannot(capsys):
    pytest.importorskip("torch")
    assert compute.main([*TINY, "--steps", "1", "--kernel-profile", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["kind"] == "kernel_profile" and result["model"] == "cnn"
    assert result["gpu_kernels"] is False and result["step_graph"] is None
    ours, theirs = result["hpcdl"], result["torch"]
    assert ours["kernels"] == [] and "NumPy" in ours["note"] and ours["device"] == "cpu"
    assert ours["wall_ms_per_step"] > 0 and theirs["wall_ms_per_step"] > 0
    assert theirs["device"] == "cpu" and theirs["note"] is None
    convs = [k for k in theirs["kernels"] if "conv" in k["name"]]
    assert convs and all(k["ms_per_step"] > 0 for k in convs)
    assert theirs["groups"]["convolution"] > 0 and theirs["kernels_per_step"] > 0
    assert any("no kernels listed" in line for line in out)  # hpcdl's line says why


def test_kernel_profile_runs_hpcdl_alone_without_torch(capsys):
    assert compute.main([*TINY, "--steps", "1", "--kernel-profile", "--no-torch", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["torch"] is None and result["hpcdl"]["plain_wall_ms_per_step"] > 0


def test_kernel_profile_and_profile_are_not_asked_together(capsys):
    with pytest.raises(SystemExit) as stopped:
        compute.main(["--kernel-profile", "--profile", "--no-torch"])
    assert stopped.value.code == 2
    assert "--kernel-profile and --profile" in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
def test_on_a_gpu_both_sides_list_their_kernels_graph_replays_included(monkeypatch, capsys):
    """CUPTI sees hpcdl's CuPy and cuDNN kernels, replayed from the step's CUDA graph too."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA")
    monkeypatch.setattr(kernels, "_enabled", kernels.enabled())  # --gpu-kernels turns them on
    argv = ["--device", "gpu", "--model", "cnn", "--batch-size", "8", "--steps", "2"]
    assert compute.main([*argv, "--gpu-kernels", "--kernel-profile", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for side in ("hpcdl", "torch"):
        assert result[side]["device"] == "cuda" and result[side]["note"] is None
        assert result[side]["kernels_per_step"] > 0 and result[side]["kernel_ms_per_step"] > 0
        assert result[side]["groups"].get("convolution", 0) > 0
    assert result["step_graph"] == "captured"
