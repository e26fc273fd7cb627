"""Image references and the image allowlist of the EKS backend (eks/images.py): whole path
components, valid references only, and allowlist entries that are registries or repositories."""

from __future__ import annotations

import pytest

from fsdp_resilience.control.backends.eks.images import check_image_prefix, image_allowed, image_repository

REPO_PREFIX = "123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdp-training"
DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    "image, allowed",
    [
        (f"{REPO_PREFIX}:1.0", True),
        (f"{REPO_PREFIX}@{DIGEST}", True),
        (f"{REPO_PREFIX}:1.0@{DIGEST}", True),
        (REPO_PREFIX, True),
        (f"{REPO_PREFIX}/nightly:2", True),  # a repository under it: whole components
        (f"{REPO_PREFIX}-evil:1", False),
        (f"{REPO_PREFIX}evil:1", False),
        (f"{REPO_PREFIX}@evil", False),  # not a digest
        (f"{REPO_PREFIX}:1 ", False),
        (f"{REPO_PREFIX}:1\n", False),
        (f"{REPO_PREFIX}:ünï", False),
        (f"{REPO_PREFIX}:../x", False),
        ("123456789012.dkr.ecr.us-west-2.amazonaws.com/other:1", False),
        ("123456789012.dkr.ecr.us-west-2.amazonaws.com.evil.io/fsdp-training:1", False),
        ("evil.io/123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdp-training:1", False),
        ("fsdp-training:1", False),
        ("", False),
    ],
)
def test_image_allowlist_matches_whole_path_components(image, allowed):
    assert image_allowed(image, [REPO_PREFIX]) is allowed
    assert image_allowed(image, [REPO_PREFIX + "/"]) is allowed  # a trailing '/' changes nothing


def test_a_registry_prefix_allows_its_repositories_and_entries_are_checked():
    registry = "123456789012.dkr.ecr.us-west-2.amazonaws.com"
    assert image_allowed(f"{REPO_PREFIX}:1", [registry]) and image_allowed(f"{registry}/other:2", [registry])
    assert not image_allowed("123456789012.dkr.ecr.us-west-2.amazonaws.com:5000/x:1", [registry])
    assert image_repository(f"{REPO_PREFIX}:1.0@{DIGEST}") == REPO_PREFIX
    assert image_repository("localhost:5000/a/b:1") == "localhost:5000/a/b"
    for bad in (f"{REPO_PREFIX}:1.0", f"{REPO_PREFIX}@{DIGEST}", "", "UPPER/Case"):
        with pytest.raises(ValueError, match="allowlist entry"):
            check_image_prefix(bad)
