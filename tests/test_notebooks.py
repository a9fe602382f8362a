"""Every notebook in notebooks/ is stored without outputs and runs top to bottom without an error.

Each is executed with nbclient on the installed "python3" kernel (ipykernel), from the notebooks
directory; the kernel inherits this process's environment, so JAX_PLATFORMS=cpu from conftest holds.
"""

import pathlib

import nbclient
import nbformat
import pytest

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # generous: the suite shares two CPU cores; a notebook should take seconds


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_is_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: code cell {index} has stored outputs; clear them"
            assert cell.execution_count is None, f"{path.name}: code cell {index} has an execution count"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_runs_without_errors(path):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )  # fmt: skip
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        pytest.fail(f"{path.name}: a cell raised\n{error}")
    ran = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert ran and all(cell.execution_count is not None for cell in ran), f"{path.name}: not every cell ran"
