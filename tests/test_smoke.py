import megatron_patches


def test_package_imports():
    assert megatron_patches.__name__ == "megatron_patches"
