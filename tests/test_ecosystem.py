"""The model zoo's libraries import and build on this torch build (CPU-only here)."""

import torch

from decompshard.check.ecosystem import import_timm, import_torchvision


def test_torchvision_and_timm_build_and_run_models():
    tv = import_torchvision()
    timm = import_timm()
    torch.manual_seed(0)
    resnet = tv.models.resnet18(num_classes=3)
    assert resnet(torch.randn(2, 3, 32, 32)).shape == (2, 3)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=4)
    assert vit(torch.randn(2, 3, 32, 32)).shape == (2, 4)


def test_importing_twice_returns_the_same_module():
    assert import_torchvision() is import_torchvision()
