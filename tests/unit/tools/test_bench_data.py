"""raytrain.tools.bench_data's command line (the benchmark itself runs in tests/integration/test_bench_data.py)."""

import pytest

from raytrain.tools import bench_data


@pytest.mark.parametrize("argv, needle", [
    (["--bogus"], "unrecognized arguments: --bogus (see python -m raytrain.tools.bench_data --help)"),
    (["--mib", "lots"], "argument --mib: invalid float value: 'lots'"),
])
def test_a_bad_flag_is_one_error_line_and_exit_2(argv, needle, capsys):
    # was argparse's usage block, then `python -m raytrain.tools.bench_data: error: ...`, unlike every other command
    assert bench_data.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [err.strip()] and err.startswith("raytrain: error: ") and needle in err, err
