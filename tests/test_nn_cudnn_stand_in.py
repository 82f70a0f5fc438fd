"""The stand-in cuDNN frontend (tests/fake_cudnn.py) is called as the real one is: every method it
offers takes the parameters of nvidia-cudnn-frontend 1.32's (names, positional order, keyword-only
names, defaults), and it accepts the real calls it used to refuse."""

import inspect

import fake_cudnn
import numpy as np
import pytest
from fake_cudnn import Module

# nvidia-cudnn-frontend 1.32.0 (cp312 wheel), as inspect.signature reads it: positional-or-keyword
# names in order, keyword-only names, defaults. The structured builders (conv_*, batchnorm*, add)
# are `(*args, name="", compute_data_type=None, out_dims=None, **kwargs)` whose positional
# arguments are the op's tensor ports, then its attributes (cudnn/_pygraph.py, _STRUCTURED_OPS).
_CONV_ATTRS = ("padding", "pre_padding", "post_padding", "stride", "dilation", "convolution_mode")
_BUILDER = ("name", "compute_data_type", "out_dims")
_BUILDER_DEFAULTS = {"name": "", "compute_data_type": None, "out_dims": None}
REAL = {
    "Module.pygraph": (("name", "io_data_type", "intermediate_data_type", "compute_data_type",
                        "handle", "sm_count", "sm_version"), (),
                       {"name": "test_graph", "io_data_type": None, "intermediate_data_type": None,
                        "compute_data_type": None, "handle": None}),
    "Module.create_handle": ((), (), {}),
    "Module.set_stream": (("handle", "stream"), (), {}),
    "Graph.tensor": (("dim", "stride", "data_type", "is_virtual", "is_pass_by_value",
                      "ragged_offset", "reordering_type", "name", "uid"), (),
                     {"stride": None, "data_type": None, "is_virtual": False,
                      "is_pass_by_value": False, "ragged_offset": None, "reordering_type": None,
                      "name": ""}),
    "Graph.conv_fprop": (("image", "weight", *_CONV_ATTRS), _BUILDER, _BUILDER_DEFAULTS),
    "Graph.conv_dgrad": (("loss", "filter", *_CONV_ATTRS), _BUILDER, _BUILDER_DEFAULTS),
    "Graph.conv_wgrad": (("image", "loss", *_CONV_ATTRS), _BUILDER, _BUILDER_DEFAULTS),
    "Graph.batchnorm": (("input", "scale", "bias", "in_running_mean", "in_running_var",
                         "epsilon", "momentum"), ("peer_stats", *_BUILDER), _BUILDER_DEFAULTS),
    "Graph.batchnorm_backward": (("grad", "input", "scale", "mean", "inv_variance"),
                                 ("peer_stats", *_BUILDER), _BUILDER_DEFAULTS),
    "Graph.add": (("a", "b"), ("name", "compute_data_type"), _BUILDER_DEFAULTS),
    "Graph.cmp_gt": (("input", "comparison"), ("name", "compute_data_type"), _BUILDER_DEFAULTS),
    "Graph.scale": (("input", "scale"), ("name", "compute_data_type"), _BUILDER_DEFAULTS),
    "Graph.batchnorm_inference": (("input", "mean", "inv_variance", "scale", "bias"), _BUILDER,
                                  _BUILDER_DEFAULTS),
    "Graph.relu": (("input", "negative_slope", "lower_clip", "upper_clip", "name",
                    "compute_data_type"), (),
                   {"negative_slope": None, "lower_clip": None, "upper_clip": None, "name": "",
                    "compute_data_type": None}),
    "Graph.relu_backward": (("loss", "input", "negative_slope", "lower_clip", "upper_clip",
                             "name", "compute_data_type"), (),
                            {"negative_slope": None, "lower_clip": None, "upper_clip": None,
                             "name": "", "compute_data_type": None}),
    "Graph.validate": ((), (), {}),
    "Graph.build_operation_graph": ((), (), {}),
    "Graph.create_execution_plans": (("heuristics",), (), {"heuristics": None}),
    "Graph.deselect_numeric_notes": (("notes",), (), {}),
    "Graph.check_support": ((), (), {}),
    "Graph.build_plans": ((), ("ctx",), {"ctx": None}),
    "Graph.get_workspace_size": (("handle", "override_uids", "override_shapes",
                                  "override_strides"), (), {"handle": None}),
    "Graph.get_execution_plan_count": ((), (), {}),
    "Graph.get_plan_name_at_index": (("index",), (), {}),
    "Graph.build_plan_at_index": (("index",), (), {}),
    "Graph.get_workspace_size_plan_at_index": (("index", "handle", "override_uids",
                                                "override_shapes", "override_strides"), (),
                                               {"handle": None, "override_uids": None,
                                                "override_shapes": None,
                                                "override_strides": None}),
    "Graph.execute_plan_at_index": (("tensor_dict", "workspace", "index", "handle"),
                                    ("tensor_uids",),
                                    {"workspace": None, "index": 0, "handle": None}),
    "Graph.execute": (("tensor_dict", "workspace", "handle", "override_uids", "override_shapes",
                       "override_strides", "tensor_uids"), (),
                      {"workspace": None, "handle": None}),
    "Tensor.set_output": (("value",), (), {}),
    "Tensor.set_dim": (("dim",), (), {}),
    "Tensor.set_stride": (("stride",), (), {}),
    "Tensor.set_data_type": (("dtype",), (), {}),
}  # fmt: skip


@pytest.mark.parametrize("method", sorted(REAL))
def test_each_stand_in_method_takes_the_real_frontends_parameters(method):
    """The stand-in's positional parameters are the real ones' first, in order; its keyword-only
    ones are real keywords; a default both have is the same."""
    owner, name = method.split(".")
    params = list(inspect.signature(getattr(getattr(fake_cudnn, owner), name)).parameters.values())
    params = [p for p in params if p.name != "self"]
    positional = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
    keyword = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    real_positional, real_keyword, real_defaults = REAL[method]
    assert positional == real_positional[: len(positional)], (positional, real_positional)
    assert keyword <= set(real_keyword) | set(real_positional), keyword - set(real_keyword)
    assert all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params), params
    for p in params:
        if p.default is not p.empty and p.name in real_defaults:
            assert p.default == real_defaults[p.name], (p.name, p.default)


def graph(module):
    dt = module.data_type
    return module.pygraph(name="g", io_data_type=dt.FLOAT, intermediate_data_type=dt.FLOAT,
                          compute_data_type=dt.FLOAT, handle=module.create_handle())  # fmt: skip


def test_relu_takes_negative_slope_and_refuses_lower_clip_slope_as_the_frontend_does():
    module = Module()
    g = graph(module)
    x = g.tensor([2, 3, 4, 4], [48, 1, 12, 3], module.data_type.FLOAT, name="x")
    g.relu(x, negative_slope=0.0, lower_clip=0.0)
    g.relu_backward(x, x, negative_slope=0.0, compute_data_type=module.data_type.FLOAT)
    with pytest.raises(TypeError, match="lower_clip_slope"):
        g.relu(input=x, lower_clip_slope=0.0)
    with pytest.raises(TypeError, match="lower_clip_slope"):
        g.relu_backward(loss=x, input=x, lower_clip_slope=0.0)
    with pytest.raises(NotImplementedError, match="leaky"):
        g.relu(x, negative_slope=0.1)


def test_tensor_takes_the_frontends_positional_order_and_defaults():
    """tensor(dim, stride=None, data_type=None, ...): row-major strides and the graph's I/O type
    where they are left out."""
    module = Module()
    g = graph(module)
    t = g.tensor([2, 3, 4, 5])
    assert t.stride == [60, 20, 5, 1] and t.data_type is module.data_type.FLOAT
    s = g.tensor([1, 1, 1, 1], [1, 1, 1, 1], module.data_type.FLOAT, False, True, name="eps")
    assert s.is_pass_by_value and s.name == "eps"
    with pytest.raises(NotImplementedError, match="virtual"):
        g.tensor([2, 3, 4, 5], is_virtual=True)


def test_the_structured_ops_take_the_frontends_ports_in_order_and_its_keywords():
    """conv_* (ports, then padding, pre/post padding, stride, dilation), batchnorm* (ports in
    order, peer_stats, name and compute_data_type by keyword)."""
    module = Module()
    g, dt = graph(module), module.data_type
    x = g.tensor([2, 3, 5, 5], [75, 1, 15, 3], dt.FLOAT, name="x")
    w = g.tensor([4, 3, 3, 3], [27, 1, 9, 3], dt.FLOAT, name="w")
    y = g.conv_fprop(
        x, w, [1, 1], None, None, [1, 1], [1, 1], name="conv", compute_data_type=dt.FLOAT
    )
    assert y.inputs["padding"] == [1, 1] and y.inputs["stride"] == [1, 1]
    y = g.conv_fprop(x, w, pre_padding=[1, 1], post_padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    assert y.inputs["padding"] == [1, 1]
    with pytest.raises(NotImplementedError, match="asymmetric"):
        g.conv_fprop(x, w, pre_padding=[1, 1], post_padding=[0, 0], stride=[1, 1], dilation=[1, 1])
    with pytest.raises(ValueError, match="stride"):
        g.conv_dgrad(loss=x, filter=w, padding=[1, 1], dilation=[1, 1])
    c = [g.tensor([1, 3, 1, 1], [3, 1, 3, 3], dt.FLOAT, name=n) for n in ("s", "b", "m", "v")]
    eps, mom = (g.tensor([1, 1, 1, 1], [1, 1, 1, 1], dt.FLOAT, is_pass_by_value=True) for _ in "em")
    outs = g.batchnorm(x, *c, eps, mom, peer_stats=[], name="bn", compute_data_type=dt.FLOAT)
    assert len(outs) == 5 and outs[0].inputs["x"] is x and outs[0].inputs["eps"] is eps
    back = g.batchnorm_backward(x, x, c[0], c[2], c[3], name="bn_backward")
    assert back[0].inputs["dy"] is x and back[0].inputs["inv_var"] is c[3]
    with pytest.raises(NotImplementedError, match="peer_stats"):
        g.batchnorm(x, *c, eps, mom, peer_stats=[x])


def test_the_build_steps_take_the_frontends_keywords_and_a_tuple_of_notes():
    """create_execution_plans(heuristics=...), deselect_numeric_notes over any sequence (it
    returns the graph), execute(tensor_dict=..., workspace=..., handle=...) with tensors or
    their names as keys, get_workspace_size(handle)."""
    module = Module()
    g, dt = graph(module), module.data_type
    x = g.tensor([2, 3, 5, 5], [75, 1, 15, 3], dt.FLOAT, name="x")
    w = g.tensor([4, 3, 3, 3], [27, 1, 9, 3], dt.FLOAT, name="w")
    y = g.conv_fprop(image=x, weight=w, padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    y.set_output(value=True).set_dim(dim=[2, 4, 5, 5]).set_stride(stride=[100, 1, 20, 4])
    y.set_data_type(dtype=dt.FLOAT)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans(heuristics=[module.heur_mode.A])
    assert g.deselect_numeric_notes((module.numerical_note.TENSOR_CORE,)) is g
    g.check_support()
    g.build_plans()
    out = np.zeros((2, 5, 5, 4), np.float32)
    ones = module.pointer(np.ones((2, 5, 5, 3), np.float32))
    pack = {"x": ones, w: module.pointer(np.ones((4, 3, 3, 3), np.float32)), y: module.pointer(out)}
    size = g.get_workspace_size(handle=module.create_handle())
    workspace = module.pointer(np.zeros(size, np.uint8))
    g.execute(tensor_dict=pack, workspace=workspace, handle=module.create_handle())
    assert out[0, 2, 2, 0] == 27
    with pytest.raises(KeyError, match="nameless"):
        g.execute({**pack, "nameless": 0}, workspace, handle=module.create_handle())
