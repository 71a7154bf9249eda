"""`train.data generate` resumes by skipping the shards that exist: they must hold the prompts the run assigns to
them, or a grown prompts file would make the dataset repeat some prompts and miss others."""

import pytest

from jaxspec.errors import JaxspecError
from train.data import check_shard_prompts, shard_path, write_shard


def _write(out, prompts, shard_size, shards):
    for i in shards:
        chunk = prompts[i * shard_size : (i + 1) * shard_size]
        write_shard(shard_path(out, i), [[1, 2, 3]] * len(chunk), [1] * len(chunk), [pid for pid, _ in chunk],
                    [True] * len(chunk))


def test_existing_shards_must_hold_the_prompts_assigned_to_them(tmp_path):
    prompts = [(f"p{i}", f"prompt {i}") for i in range(10)]
    _write(tmp_path, prompts, 4, [0, 2])  # shard 1 missing: a killed run
    check_shard_prompts(tmp_path, prompts, 4)  # the same prompts: resume
    check_shard_prompts(tmp_path, prompts[:9], 4)  # a smaller --limit: the last shard holds one prompt more
    _write(tmp_path, prompts[:9], 4, [2])  # written under --limit 9; resumed without it, p9 would never be written
    with pytest.raises(JaxspecError, match=r"shard-00002\.npz holds other prompts"):
        check_shard_prompts(tmp_path, prompts, 4)
    _write(tmp_path, prompts, 4, [2])
    grown = prompts[:4] + [("new", "a new prompt")] + prompts[4:]  # a rerun of `prompts` put one in the middle
    with pytest.raises(JaxspecError, match=r"shard-00002\.npz holds other prompts .* use a new --out"):
        check_shard_prompts(tmp_path, grown, 4)
    with pytest.raises(JaxspecError, match="shard-00000"):
        check_shard_prompts(tmp_path, prompts[::-1], 4)  # another shuffle
