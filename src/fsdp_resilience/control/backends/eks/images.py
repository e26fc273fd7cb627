"""Container image references and the image allowlist of the EKS backend: whoever triggers a run
cannot bring an arbitrary image to the shared FSx (``image_allowed``).
"""

from __future__ import annotations

import re

# The reference grammar of the distribution project (what containerd and the registries parse):
# [domain[:port]/]path-component(/path-component)*[:tag][@algorithm:hex].
_DOMAIN_COMPONENT = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_DOMAIN = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_IMAGE_NAME = re.compile(_NAME)  # always fullmatch: "$" would let a newline through
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]{32,}"
_IMAGE_REFERENCE = re.compile(rf"(?P<name>{_NAME})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?")
_NAME_MAX = 255


def image_repository(image: str) -> str:
    """The repository of an image reference: the reference without its ``:tag`` and ``@digest``
    (``123.dkr.ecr.us-west-2.amazonaws.com/fsdp-training:1.0`` -> ``...amazonaws.com/fsdp-training``).
    Raises ValueError for what is not a valid reference."""
    match = _IMAGE_REFERENCE.fullmatch(image) if isinstance(image, str) else None
    if not match or len(match.group("name")) > _NAME_MAX:
        raise ValueError(
            f"{image!r} is not a container image reference such as "
            "'123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdp-training:1.0' (registry/repository, "
            "then :tag and/or @sha256:<digest>)"
        )
    return match.group("name")


def check_image_prefix(prefix: str) -> str:
    """An allowlist entry, normalised (no trailing '/'): a registry (``123.dkr.ecr...amazonaws.com``)
    or a repository in it (``.../fsdp-training``), never with a tag or digest."""
    text = prefix.strip().rstrip("/") if isinstance(prefix, str) else ""
    if not text or not _IMAGE_NAME.fullmatch(text):
        raise ValueError(
            f"image allowlist entry {prefix!r} is not a registry or repository such as "
            "'123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdp-training' (no :tag, no @digest)"
        )
    return text


def image_allowed(image: str, prefixes: list[str] | tuple[str, ...]) -> bool:
    """Whether ``image`` is in a repository under one of ``prefixes``, compared by whole path
    components: ``.../fsdp-training`` allows ``.../fsdp-training:1.0``, ``.../fsdp-training@sha256:...``
    and ``.../fsdp-training/sub:1``, never ``.../fsdp-training-evil:1``. An image that is not a valid
    reference is never allowed. Comparison is textual: ``ubuntu`` is not ``docker.io/library/ubuntu``."""
    try:
        components = image_repository(image).split("/")
    except ValueError:
        return False
    for prefix in prefixes:
        wanted = check_image_prefix(prefix).split("/")
        if components[: len(wanted)] == wanted:
            return True
    return False
