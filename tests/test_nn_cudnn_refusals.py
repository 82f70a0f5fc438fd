"""Each refusal of the stand-in cuDNN frontend (tests/fake_cudnn.py) that no other test reaches:
the stand-in called the wrong way refuses with the kind of error the real frontend (1.32)
raises, at its own call or when it lowers the graph. The other refusals are tested in
tests/test_nn_cudnn.py, tests/test_nn_cudnn_stand_in.py and tests/test_gpu_float64_kernels.py."""

import fake_cudnn
import numpy as np
import pytest
from fake_cudnn import Module


def graph(module, io="FLOAT"):
    dt = module.data_type
    return module.pygraph(io_data_type=dt[io], intermediate_data_type=dt.FLOAT,
                          compute_data_type=dt.FLOAT, handle=module.create_handle())  # fmt: skip


def nhwc(g, name, n=2, c=3, hw=4, data_type=None):
    dt = data_type or g.module.data_type.FLOAT
    return g.tensor([n, c, hw, hw], [hw * hw * c, 1, hw * c, c], dt, name=name)


def built_relu(module):
    """A built relu graph over (2, 4, 4, 3): (graph, x, z)."""
    g = graph(module)
    x = nhwc(g, "x")
    z = g.relu(x, compute_data_type=module.data_type.FLOAT)
    z.set_output(True).set_dim(x.dim).set_stride(x.stride).set_data_type(x.data_type)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([module.heur_mode.A])
    g.check_support()
    g.build_plans()
    return g, x, z


def execute(module, g, pack):
    g.execute(pack, module.pointer(np.zeros(64, np.uint8)), handle=module.create_handle())


def test_the_stand_in_runs_a_well_formed_relu():
    module = Module()
    g, x, z = built_relu(module)
    a, out = np.array([-1.0, 2.0] * 48, np.float32), np.zeros(96, np.float32)
    execute(module, g, {x: module.pointer(a), z: module.pointer(out)})
    assert out.tolist() == [0.0, 2.0] * 48


def test_set_stream_and_pygraph_refuse_what_is_no_handle_and_a_stream_that_is_no_address():
    module = Module()
    with pytest.raises(TypeError, match=r"expects a cudnn.Handle \(from cudnn.create_handle"):
        module.set_stream(handle=7, stream=0)
    with pytest.raises(TypeError, match="stream address"):
        module.set_stream(handle=module.create_handle(), stream="0")
    dt = module.data_type
    with pytest.raises(TypeError, match="pygraph handle"):
        module.pygraph(io_data_type=dt.FLOAT, intermediate_data_type=dt.FLOAT,
                       compute_data_type=dt.FLOAT, handle=None)  # fmt: skip


def test_the_stand_ins_device_memory_is_c_contiguous_numpy_arrays():
    with pytest.raises(TypeError, match="C-contiguous"):
        Module().pointer(np.ones((4, 4), np.float32).T)


def test_an_op_refuses_another_graphs_tensor_and_what_is_no_tensor():
    """Another graph's tensor: ValueError; no tensor: the frontend's tensor_like fails on it
    (AttributeError: no shape); an array, which the frontend binds, is refused too."""
    module = Module()
    g, other = graph(module), graph(module)
    x, foreign = nhwc(g, "x"), nhwc(other, "y")
    with pytest.raises(ValueError, match="another graph"):
        g.add(x, foreign)
    with pytest.raises(ValueError, match="another graph"):
        g.conv_fprop(x, foreign, padding=[0, 0], stride=[1, 1], dilation=[1, 1])
    with pytest.raises(AttributeError, match="'float' object has no attribute 'shape'"):
        g.relu(input=0.5)
    with pytest.raises(AttributeError, match="'float' object has no attribute 'shape'"):
        g.batchnorm(x, x, x, x, x, 1e-5, 0.1)  # epsilon by value, not as a tensor
    with pytest.raises(TypeError, match="expected a cudnn tensor"):
        g.add(a=x, b=np.ones((2, 4, 4, 3), np.float32))


def test_pointwise_ops_refuse_a_compute_type_that_is_no_data_type_and_clips_not_floats():
    module = Module()
    g = graph(module)
    x = nhwc(g, "x")
    with pytest.raises(TypeError, match="compute_data_type"):
        g.relu(x, compute_data_type="FLOAT")
    with pytest.raises(TypeError, match="compute_data_type"):
        g.add(x, x, compute_data_type=np.float32)
    with pytest.raises(TypeError, match="clips are floats"):
        g.relu(x, lower_clip="0")
    with pytest.raises(TypeError, match="clips are floats"):
        g.relu_backward(x, x, negative_slope=[0.0])
    with pytest.raises(NotImplementedError, match="clipped"):
        g.relu(x, upper_clip=6.0)


def test_batchnorm_refuses_statistics_not_in_float_and_a_graph_without_running_statistics():
    module = Module()
    g, dt = graph(module), module.data_type
    x = nhwc(g, "x")
    half = [g.tensor([1, 3, 1, 1], [3, 1, 3, 3], dt.HALF, name=n) for n in "sbmv"]
    eps, mom = (g.tensor([1, 1, 1, 1], data_type=dt.FLOAT, is_pass_by_value=True) for _ in "em")
    with pytest.raises(NotImplementedError, match="running statistics"):
        g.batchnorm(x, half[0], half[1], epsilon=eps, momentum=mom)
    outs = g.batchnorm(x, *half, eps, mom)
    for out in outs:
        out.set_output(True).set_dim(x.dim if out is outs[0] else [1, 3, 1, 1])
        out.set_stride(x.stride if out is outs[0] else [3, 1, 3, 3]).set_data_type(dt.FLOAT)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([module.heur_mode.A])
    with pytest.raises(fake_cudnn.cudnnGraphNotSupportedError, match="statistics must be FLOAT"):
        g.check_support()


def test_validate_refuses_an_output_without_its_dim_and_stride():
    """The frontend: ValueError, "Tensor '...' dims not set."""
    module = Module()
    g = graph(module)
    g.relu(nhwc(g, "x")).set_output(True)
    with pytest.raises(ValueError, match="dim and stride"):
        g.validate()


def test_a_note_filter_is_a_sequence_of_notes():
    module = Module()
    g = graph(module)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([module.heur_mode.A])
    with pytest.raises(TypeError, match="takes a list"):
        g.deselect_numeric_notes(module.numerical_note.TENSOR_CORE)


def test_the_variant_pack_refuses_another_graphs_tensor_as_a_key():
    """Beside a complete pack: the frontend would take its uid for one of this graph's."""
    module = Module()
    g, x, z = built_relu(module)
    foreign = nhwc(graph(module), "x")
    a = module.pointer(np.ones(96, np.float32))
    pack = {x: a, z: module.pointer(np.zeros(96, np.float32))}
    with pytest.raises(ValueError, match="no tensor of this graph"):
        execute(module, g, {**pack, foreign: a})


def test_a_pass_by_value_scalar_is_a_host_float_or_int64_at_a_plausible_address():
    module = Module()
    g, dt = graph(module), module.data_type
    half = g.tensor([1, 1, 1, 1], data_type=dt.HALF, is_pass_by_value=True, name="h")
    scalar = g.tensor([1, 1, 1, 1], data_type=dt.FLOAT, is_pass_by_value=True, name="f")
    host = np.full(1, 0.5, np.float16)
    with pytest.raises(ValueError, match="no host"):
        fake_cudnn._Host(int(host.ctypes.data), half, module)
    with pytest.raises(ValueError, match="no host"):
        fake_cudnn._Host(16, scalar, module)  # a null page, not a scalar's address


def test_an_outputs_dim_stride_and_data_type_are_checked_as_an_inputs():
    module = Module()
    g = graph(module)
    z = g.relu(nhwc(g, "x"))
    with pytest.raises(TypeError, match="dim must hold ints"):
        z.set_dim([2.0, 3, 4, 4])
    z.set_dim([2, 3, 4, 4])
    with pytest.raises(TypeError, match="stride must be a list of 4"):
        z.set_stride([48, 1, 12])
    with pytest.raises(TypeError, match="set_data_type"):
        z.set_data_type("FLOAT")


def test_a_convolutions_padding_stride_and_dilation_are_two_ints():
    """The frontend takes them at the call and its lowering refuses them (pybind: TypeError)."""
    module = Module()
    g = graph(module)
    x, w = nhwc(g, "x"), nhwc(g, "w", n=4)
    conv = {"padding": [1, 1], "stride": [1, 1], "dilation": [1, 1]}
    for key, bad in (("padding", 1), ("stride", [1, 1, 1]), ("dilation", [1.0, 1])):
        with pytest.raises(TypeError, match=key):
            g.conv_fprop(x, w, **{**conv, key: bad})
    with pytest.raises(TypeError, match="pre_padding"):
        g.conv_wgrad(x, x, pre_padding=[1], post_padding=[1], stride=[1, 1], dilation=[1, 1])
    with pytest.raises(TypeError, match="post_padding"):
        g.conv_dgrad(x, w, pre_padding=[1, 1], post_padding=1, stride=[1, 1], dilation=[1, 1])


def test_batchnorm_backward_refuses_peer_statistics_the_stand_in_does_not_model():
    module = Module()
    g = graph(module)
    x = nhwc(g, "x")
    with pytest.raises(NotImplementedError, match="peer_stats"):
        g.batchnorm_backward(x, x, x, x, x, peer_stats=[x])


def test_every_build_step_refuses_to_run_out_of_order():
    module = Module()
    g = graph(module)
    with pytest.raises(RuntimeError, match="operation_graph called out of order"):
        g.build_operation_graph()
    g.validate()
    with pytest.raises(RuntimeError, match="validate called out of order"):
        g.validate()
    with pytest.raises(RuntimeError, match="plans called out of order"):
        g.create_execution_plans([module.heur_mode.A])
    g.build_operation_graph()
    with pytest.raises(RuntimeError, match="support called out of order"):
        g.check_support()
    with pytest.raises(TypeError, match="heur_mode"):
        g.create_execution_plans(["A"])
