"""ATC command rules from docs/atc-facts.md, the SoC table and resolution, error codes."""

from __future__ import annotations

import pytest

from vlmc.backends.ascend import atc, soc
from vlmc.errors import VlmcError

BASE = {"model": "m.onnx", "framework": "5", "output": "out/m", "soc_version": "Ascend910B3"}


def _opts(**extra) -> dict:
    return {**BASE, **{k: str(v) for k, v in extra.items()}}


def test_valid_minimal_command_has_no_problems():
    assert atc.problems(_opts()) == []
    cmd = atc.build(_opts(input_format="ND", input_shape="ids:1,-1", dynamic_dims="128;256"), sequence=True)
    assert cmd.argv()[:2] == ["atc", "--model=m.onnx"]
    assert atc.parse_argv(cmd.argv()) == cmd.options


@pytest.mark.parametrize("missing", atc.REQUIRED)
def test_required_options(missing):
    opts = _opts()
    del opts[missing]
    assert any(f"--{missing} is required" in p for p in atc.problems(opts))


def test_flag_table_is_the_complete_atc_list():
    assert len(atc.FLAGS) == 83  # the words in the reference's "complete flag list"
    for flag in (
        "input_shape",
        "dynamic_dims",
        "precision_mode_v2",
        "keep_dtype",
        "modify_mixlist",
        "soc_version",
    ):
        assert flag in atc.FLAGS


@pytest.mark.parametrize("flag", sorted(atc.NOT_ATC_FLAGS) + ["made_up_flag"])
def test_unknown_and_blog_flags_rejected(flag):
    problems = atc.problems(_opts(**{flag: "1"}))
    assert any(f"--{flag} is not an ATC option" in p for p in problems)
    with pytest.raises(VlmcError, match=flag):
        atc.build(_opts(**{flag: "1"}))


def test_output_takes_no_suffix_and_framework_is_onnx():
    assert any("no suffix" in p for p in atc.problems(_opts(output="m.om")))
    assert any("--framework must be 5" in p for p in atc.problems(_opts(framework="3")))


@pytest.mark.parametrize("variant", soc.VARIANTS_910B)
def test_910b_variants_are_valid_soc_versions(variant):
    assert atc.problems(_opts(soc_version=variant)) == []


@pytest.mark.parametrize("bad", ["Ascend910B", "Ascend910B9", "910B3"])
def test_bare_family_and_unknown_soc_rejected(bad):
    assert atc.problems(_opts(soc_version=bad))


def test_input_shape_range_never_allowed():
    assert any("deprecated" in p for p in atc.problems(_opts(input_shape_range="x:[1~4]")))


@pytest.mark.parametrize(
    "a,b",
    [
        ("dynamic_dims", "dynamic_batch_size"),
        ("dynamic_dims", "dynamic_image_size"),
        ("dynamic_batch_size", "dynamic_image_size"),
    ],
)
def test_gear_options_mutually_exclusive(a, b):
    values = {"dynamic_dims": "1;2", "dynamic_batch_size": "1,2", "dynamic_image_size": "2,2;4,4"}
    opts = _opts(input_shape="x:-1,3,-1,-1", **{a: values[a], b: values[b]})
    assert any("mutually exclusive" in p for p in atc.problems(opts))


@pytest.mark.parametrize(
    "profiles,ok",
    [
        (["128"], False),
        (["128", "256"], True),
        ([str(i) for i in range(1, 101)], True),
        ([str(i) for i in range(1, 102)], False),
    ],
)
def test_dynamic_dims_profile_count_2_to_100(profiles, ok):
    opts = _opts(input_format="ND", input_shape="ids:1,-1", dynamic_dims=";".join(profiles))
    assert (atc.problems(opts, sequence=True) == []) is ok


def test_dynamic_dims_profile_arity_matches_minus_ones():
    opts = _opts(input_format="ND", input_shape="a:1,-1;b:1,-1", dynamic_dims="1;2")
    assert any("has 1 values but --input_shape has 2" in p for p in atc.problems(opts))
    opts["dynamic_dims"] = "1,1;2,2"
    assert atc.problems(opts) == []


def test_dynamic_dims_values_positive_and_not_with_aipp():
    assert atc.problems(_opts(input_shape="a:-1", dynamic_dims="0;2"))
    assert any(
        "insert_op_conf" in p
        for p in atc.problems(_opts(input_shape="a:-1", dynamic_dims="1;2", insert_op_conf="aipp.cfg"))
    )


def test_minus_one_without_gears_is_flagged_and_ranges_exclude_gears():
    assert any("fully dynamic" in p for p in atc.problems(_opts(input_shape="a:1,-1")))
    assert atc.problems(_opts(input_shape="a:1,1~128")) == []
    assert any("ranges" in p for p in atc.problems(_opts(input_shape="a:-1,1~128", dynamic_dims="1;2")))


def test_dynamic_image_size_only_h_w():
    assert atc.problems(_opts(input_shape="x:1,3,-1,-1", dynamic_image_size="224,224;448,448")) == []
    assert atc.problems(_opts(input_shape="x:-1,3,224,224", dynamic_image_size="224,224;448,448"))


def test_precision_rules():
    assert any(
        "mutually exclusive" in p
        for p in atc.problems(_opts(precision_mode="force_fp16", precision_mode_v2="fp16"))
    )
    assert atc.problems(_opts(precision_mode_v2="fp32"))  # not a v2 value
    assert any(
        "modify_mixlist" in p for p in atc.problems(_opts(precision_mode_v2="fp16", modify_mixlist="m.json"))
    )
    assert atc.problems(_opts(precision_mode_v2="mixed_float16", modify_mixlist="m.json")) == []
    assert atc.problems(_opts(precision_mode="allow_mix_precision_bf16", modify_mixlist="m.json")) == []
    assert any("keep_dtype" in p for p in atc.problems(_opts(precision_mode_v2="origin", keep_dtype="k.cfg")))
    assert any("op_select_implmode" in p for p in atc.problems(_opts(optypelist_for_implmode="Pow")))


@pytest.mark.parametrize(
    "opt",
    [
        {"dynamic_batch_size": "1,2", "input_shape": "x:-1,4"},
        {"dynamic_image_size": "2,2;4,4", "input_shape": "x:1,3,-1,-1"},
        {"precision_mode": "force_fp32"},
        {"precision_mode": "must_keep_origin_dtype"},
        {"precision_mode_v2": "origin"},
    ],
)
def test_quantized_model_limits(opt):
    opts = _opts(**opt)
    assert atc.problems(opts) == []
    assert any("quantized" in p for p in atc.problems(opts, quantized=True))


def test_sequence_graph_needs_nd():
    assert any("ND" in p for p in atc.problems(_opts(), sequence=True))
    assert atc.problems(_opts(input_format="ND"), sequence=True) == []


@pytest.mark.parametrize(
    "flag,value", [("log", "verbose"), ("host_env_cpu", "riscv"), ("mode", "2"), ("input_format", "NHWC")]
)
def test_enumerated_values(flag, value):
    assert any(f"--{flag}={value}" in p for p in atc.problems(_opts(**{flag: value})))


def test_parse_argv_rejects_malformed_and_repeated():
    with pytest.raises(VlmcError):
        atc.parse_argv(["atc", "--model", "m.onnx"])
    with pytest.raises(VlmcError):
        atc.parse_argv(["atc", "--log=info", "--log=error"])


def test_explain_error_codes():
    log = (
        "ATC run failed, Please check the detail log...\nE16002: No parser for op GroupQueryAttention\n"
        "ERROR: unknown command line flag 'enable_fusion'\nE10009: mutually exclusive\n"
    )
    msgs = atc.explain(log)
    assert any("--enable_fusion" in m for m in msgs)
    assert any(m.startswith("E16002: the ONNX parser has no plugin") for m in msgs)
    assert any(m.startswith("E10009") for m in msgs)


def test_om_files_include_dynamic_shape_suffix(tmp_path):
    (tmp_path / "a.om").write_bytes(b"x")
    (tmp_path / "b_linux_x86_64.om").write_bytes(b"x")
    assert atc.om_files(tmp_path / "a") == [tmp_path / "a.om"]
    assert atc.om_files(tmp_path / "b") == [tmp_path / "b_linux_x86_64.om"]


NPU_SMI = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.rc2                 Version: 23.0.rc2                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B4               | OK            | 93.9        36                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3161 / 32768         |
+===========================+===============+====================================================+
| 1     910B4               | OK            | 90.1        35                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          3161 / 32768         |
+===========================+===============+====================================================+
"""


def test_parse_npu_smi():
    assert soc.parse_npu_smi(NPU_SMI) == ["Ascend910B4", "Ascend910B4"]


def test_resolution_order():
    assert soc.resolve("Ascend910B", "B2", detected=["Ascend910B4"]).soc_version == "Ascend910B4"
    r = soc.resolve("Ascend910B", "B2", detected=["Ascend910B4"])
    assert r.source == "npu-smi" and "ignored" in r.warning
    assert soc.resolve("Ascend910B", "Ascend910B2C", detected=[]) == soc.Resolution(
        "Ascend910B2C", "soc_variant"
    )
    d = soc.resolve("Ascend910B", None, detected=[])
    assert d.soc_version == soc.DEFAULT_910B and d.source == "default" and d.warning
    assert soc.resolve("Ascend310P3", None, detected=["Ascend910B4"]).soc_version == "Ascend310P3"
    for name in ("Ascend910B", "Ascend310P3"):
        assert soc.resolve(name, None, detected=[]).soc_version in soc.SOCS


def test_resolution_errors_list_valid_names():
    with pytest.raises(VlmcError, match="Ascend910B1"):
        soc.resolve("Ascend910B9", None, detected=[])
    with pytest.raises(VlmcError, match="not a Ascend910B variant"):
        soc.resolve("Ascend910B", "B9", detected=[])
    with pytest.raises(VlmcError, match="several"):
        soc.resolve("Ascend910B", None, detected=["Ascend910B3", "Ascend910B4"])
