"""Ascend SoC names ATC accepts, and resolving a family name (Ascend910B) to an exact variant."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from dataclasses import dataclass

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# ATC treats a bare "Ascend910B" as the first-generation 910, so the family name is never passed on.
FAMILY_910B = "Ascend910B"
VARIANTS_910B = ("Ascend910B1", "Ascend910B2", "Ascend910B2C", "Ascend910B3", "Ascend910B4", "Ascend910B4-1")
# Used when neither npu-smi nor --soc-variant says which 910B this is; Atlas 800T A2 servers carry B3.
DEFAULT_910B = "Ascend910B3"


@dataclass(frozen=True)
class Soc:
    """One exact --soc_version value."""

    name: str
    family: str
    note: str = ""


# Exact targets. Other families can be added here; each needs only its ATC --soc_version string.
SOCS: dict[str, Soc] = {
    **{v: Soc(v, FAMILY_910B) for v in VARIANTS_910B},
    "Ascend310P1": Soc("Ascend310P1", "Ascend310P", "Atlas 300I inference card"),
    "Ascend310P3": Soc("Ascend310P3", "Ascend310P", "Atlas 300I Pro / 300V Pro"),
    "Ascend310B1": Soc("Ascend310B1", "Ascend310B", "Atlas 200I A2"),
}

# Family names a user may give; each resolves to one of its variants, never to itself.
FAMILIES: dict[str, tuple[tuple[str, ...], str]] = {
    FAMILY_910B: (VARIANTS_910B, DEFAULT_910B),
}


@dataclass(frozen=True)
class Resolution:
    """The exact SoC chosen and how it was chosen (for compile.json and the log)."""

    soc_version: str
    source: str  # "exact" | "npu-smi" | "soc_variant" | "default"
    warning: str | None = None


def valid_names() -> list[str]:
    """Every name accepted by --soc: exact SoCs and families."""
    return sorted(SOCS) + sorted(FAMILIES)


def normalize_variant(family: str, variant: str) -> str | None:
    """Accept 'Ascend910B4', '910B4' or 'B4' for a family; None if it names no variant of it."""
    variants, _ = FAMILIES[family]
    # "B4" names the variant by its suffix after "Ascend910"; "910B4" after "Ascend".
    for candidate in (variant, f"Ascend{variant}", f"{family[:-1]}{variant}"):
        for v in variants:
            if candidate.lower() == v.lower():
                return v
    return None


def check(soc: str, soc_variant: str | None, where: str) -> None:
    """Validate the target's soc/soc_variant options (no probing of the machine)."""
    if soc not in SOCS and soc not in FAMILIES:
        raise VlmcError(
            f"{where}: soc {soc!r} is not a known Ascend target; valid: {', '.join(valid_names())}"
        )
    if soc_variant is not None:
        if soc not in FAMILIES:
            raise VlmcError(
                f"{where}: soc_variant is only used with a family soc ({', '.join(FAMILIES)}), not {soc!r}"
            )
        if normalize_variant(soc, soc_variant) is None:
            variants, _ = FAMILIES[soc]
            raise VlmcError(
                f"{where}: soc_variant {soc_variant!r} is not a {soc} variant; valid: {', '.join(variants)}"
            )


def parse_npu_smi(text: str) -> list[str]:
    """The chip names in `npu-smi info` output, as --soc_version values ("Ascend" + the Name column).

    The table's first row for each NPU reads ``| 0     910B3     | OK | ...``; the second row of the
    same NPU starts with the chip id and no name, so it does not match.
    """
    names = []
    for line in text.splitlines():
        m = re.match(r"^\|\s*\d+\s+([0-9][0-9A-Za-z]*(?:-\d+)?)\s+\|", line)
        if m:
            names.append("Ascend" + m.group(1))
    return names


def probe_npu_smi(timeout: float = 10.0) -> list[str]:
    """Chip names from `npu-smi info` when the binary is on PATH, else an empty list."""
    exe = shutil.which("npu-smi")
    if exe is None:
        return []
    try:
        proc = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("npu-smi info failed (%s); not using it to pick the SoC", exc)
        return []
    if proc.returncode != 0:
        logger.warning("npu-smi info exited with %d; not using it to pick the SoC", proc.returncode)
        return []
    return parse_npu_smi(proc.stdout)


def resolve(soc: str, soc_variant: str | None = None, detected: list[str] | None = None) -> Resolution:
    """Turn the target's soc (maybe a family) into the exact --soc_version.

    Order for a family: the chip `npu-smi info` reports, then ``soc_variant``, then the family's
    documented default with a warning. An exact SoC is used as given.

    Args:
        soc: an exact SoC or a family name.
        soc_variant: the variant to use when no NPU is visible.
        detected: chip names from npu-smi; probed when None.
    """
    check(soc, soc_variant, "target")
    if soc in SOCS:
        return Resolution(soc, "exact")
    variants, default = FAMILIES[soc]
    chosen = normalize_variant(soc, soc_variant) if soc_variant else None
    found = probe_npu_smi() if detected is None else detected
    found_in_family = sorted({n for n in found if n in variants})
    if found_in_family:
        if len(found_in_family) > 1:
            raise VlmcError(
                f"npu-smi reports several {soc} variants ({', '.join(found_in_family)}); "
                f"give an exact --soc such as {found_in_family[0]}"
            )
        hit = found_in_family[0]
        warning = None
        if chosen is not None and chosen != hit:
            warning = (
                f"npu-smi reports {hit}, so --soc-variant {chosen} is ignored; "
                f"pass --soc {chosen} to build for another chip"
            )
            logger.warning(warning)
        return Resolution(hit, "npu-smi", warning)
    if chosen is not None:
        return Resolution(chosen, "soc_variant")
    warning = (
        f"--soc {soc} is a family and no NPU was found; building for {default} "
        f"(pass --soc-variant, one of {', '.join(variants)}, to choose)"
    )
    logger.warning(warning)
    return Resolution(default, "default", warning)
