"""`--run-file`: a role takes its run id from the run file's `name` (one source for a deployment's run id and
config); a missing or bad file, or a --run-id that disagrees, is refused naming the file."""

import pytest
from pydantic import ValidationError

from services.role.role_service import RoleSettings


def test_the_run_id_is_the_run_files_name(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("name: my-run\nmodel: /model\nstack: {engines: 2}\n")
    assert RoleSettings(run_file=str(run)).run_id == "my-run"
    assert RoleSettings(run_file=str(run), run_id="my-run").run_id == "my-run"
    assert RoleSettings().run_id == "default"  # without a run file: --run-id as before


@pytest.mark.parametrize(
    "content, problem",
    [
        (None, "cannot be read"),
        ("name: [unclosed", "not valid YAML"),
        ("model: /model\n", "no top-level `name`"),
        ("name: 'has space'\n", "does not match"),
    ],
)
def test_a_bad_run_file_is_refused_naming_it(tmp_path, content, problem):
    run = tmp_path / "run.yaml"
    if content is not None:
        run.write_text(content)
    with pytest.raises(ValidationError) as exc:
        RoleSettings(run_file=str(run))
    assert problem in str(exc.value) and str(run) in str(exc.value)


def test_a_run_id_that_disagrees_with_the_file_is_refused(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("name: my-run\n")
    with pytest.raises(ValidationError, match="differs from the name 'my-run'"):
        RoleSettings(run_file=str(run), run_id="other")
