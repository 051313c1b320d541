"""Which operators exist: onnx's schemas, and onnxruntime's for its own domains.

Rules name operators by string (`op.Sigmoid`, `b.op("FusedConv", domain="com.microsoft")`),
so a misspelling would otherwise only show as a pattern that never matches or a model
onnxruntime refuses. A domain neither onnx nor onnxruntime defines is a custom domain:
fuser cannot check its operators and accepts them where the rule declares the domain.
"""

from __future__ import annotations

import difflib
import functools

DEFAULT_DOMAINS = ("", "ai.onnx")


@functools.cache
def catalogue() -> dict[str, dict[str, tuple[int, ...]]]:
    """{domain: {op_type: since_versions}}, the default domain under ""."""
    import onnx.defs

    found: dict[str, dict[str, set[int]]] = {}

    def add(domain: str, name: str, since: int) -> None:
        domain = "" if domain in DEFAULT_DOMAINS else domain
        found.setdefault(domain, {}).setdefault(name, set()).add(int(since))

    for schema in onnx.defs.get_all_schemas_with_history():
        add(schema.domain, schema.name, schema.since_version)
    try:  # onnxruntime's contrib operators (com.microsoft, com.microsoft.nchwc, ...)
        from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema
    except ImportError:  # a build without the schema list: its domains count as custom
        get_all_operator_schema = list
    for schema in get_all_operator_schema():
        add(schema.domain, schema.name, schema.since_version)
    return {domain: {name: tuple(sorted(v)) for name, v in ops.items()} for domain, ops in found.items()}


def is_known_domain(domain: str) -> bool:
    return ("" if domain in DEFAULT_DOMAINS else domain) in catalogue()


def unknown_op(op_type: str, domain: str = "", version: int | None = None) -> str | None:
    """Why `op_type` does not exist in `domain` at opset `version` (None: at any version), or
    None when it does or when the domain is a custom one fuser cannot check."""
    domain = "" if domain in DEFAULT_DOMAINS else domain
    ops = catalogue().get(domain)
    if ops is None:
        return None
    where = "the default ONNX domain" if domain == "" else f"domain '{domain}'"
    versions = ops.get(op_type)
    if versions is None:
        close = difflib.get_close_matches(op_type, ops, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"there is no operator '{op_type}' in {where}{hint}"
    if version is not None and versions[0] > version:
        return f"'{op_type}' does not exist in {where} at opset {version} (it was added in opset {versions[0]})"
    return None
