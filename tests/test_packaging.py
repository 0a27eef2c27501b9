"""The package as installed: every subpackage is listed in setup.cfg, kernels map under mpidist."""
import configparser
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed_in_setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "mpidist").rglob("__init__.py")}
    found.add("mpidist.kernels")
    assert found - listed == set(), "add these packages to setup.cfg [options] packages"
    assert "mpidist.kernels = kernels" in cfg["options"]["package_dir"]


def test_kernels_import_as_part_of_mpidist():
    import mpidist.kernels.backend as backend
    assert pathlib.Path(backend.__file__).resolve().parent == ROOT / "kernels"
