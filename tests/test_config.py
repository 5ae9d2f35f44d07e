import pytest

from lmkv.config import ConfigError, load_config


def test_defaults_work_without_anything():
    cfg = load_config(environ={})
    assert cfg.memory.capacity == 2 << 30
    assert cfg.memory.policy == "s3fifo"
    assert cfg.disk.path is None
    assert cfg.store.write_policy == "write_through"


def test_precedence_file_then_env_then_dict(tmp_path):
    f = tmp_path / "lmkv.yaml"
    f.write_text("namespace: from-file\nmemory:\n  capacity: 1GiB\n  policy: lru\ndisk:\n  path: /x\n")
    env = {"LMKV_CONFIG": str(f), "LMKV_MEMORY__CAPACITY": "512MiB", "LMKV_DISK__FSYNC": "false"}
    cfg = load_config({"namespace": "from-dict"}, environ=env)
    assert cfg.namespace == "from-dict"
    assert cfg.memory.capacity == 512 << 20  # env beats file
    assert cfg.memory.policy == "lru"  # file beats default
    assert cfg.disk.path == "/x"
    assert cfg.disk.fsync is False


def test_config_file_key_in_dict(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("domain: shared-owner\n")
    assert load_config({"config_file": str(f)}, environ={}).domain == "shared-owner"


@pytest.mark.parametrize(
    "overrides, field, value, accepted",
    [
        ({"memory": {"policy": "fifo"}}, "memory.policy", "'fifo'", "'lru' or 's3fifo'"),
        ({"memory": {"capacity": "lots"}}, "memory.capacity", "'lots'", "byte size"),
        ({"store": {"io_threads": 0}}, "store.io_threads", "0", "greater than or equal to 1"),
        ({"disk": {"io": "gds2"}}, "disk.io", "'gds2'", "'auto', 'buffered', 'direct' or 'gds'"),
    ],
)
def test_bad_value_names_field_value_and_accepted(overrides, field, value, accepted):
    with pytest.raises(ConfigError) as e:
        load_config(overrides, environ={})
    msg = str(e.value)
    assert field in msg and value in msg and accepted in msg


def test_unknown_setting_lists_accepted_ones():
    with pytest.raises(ConfigError) as e:
        load_config({"memory": {"capacty": "1GiB"}}, environ={})
    assert "memory.capacty: unknown setting" in str(e.value)
    assert "capacity" in str(e.value) and "policy" in str(e.value)


def test_bad_env_value_is_reported_with_its_field():
    with pytest.raises(ConfigError, match=r"memory.prefault = 'maybe'"):
        load_config(environ={"LMKV_MEMORY__PREFAULT": "maybe"})


def test_bad_yaml_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("- a list\n- not a mapping\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config({"config_file": str(f)}, environ={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config({"config_file": str(tmp_path / "missing.yaml")}, environ={})
