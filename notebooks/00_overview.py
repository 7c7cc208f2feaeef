# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown] tags=["remove-cell"]
# # overview (both handouts)
# Every handout problem, the notebook or code that answers it, the tests that cover it and its status.
# (In the PDF this table follows writeup.md's "Overview" heading.)

# %% tags=["parameters"]
measure = "auto"  # nothing is measured here: the table is read from the index and the committed rows
quick = False  # the same table from a scratch results directory (rows measured by quick runs, if any)

# %% tags=["remove-input"]
from cs336_systems.report import nb, show_table
from cs336_systems.studies.overview import problem_index

results_dir = nb.setup(quick)
table = problem_index.overview(results_dir)
facts = problem_index.facts(table)

# %% tags=["remove-input"]
nb.md(
    f"The table lists the {facts['problems_2025']} problems of the 2025 handout in its order, then "
    f"{facts['problems_2026']} additions of the 2026 handout. Of these, {facts['code_only']} are code only: their "
    "deliverable is a class that the official tests exercise (`tests/adapters.py` maps every official "
    "adapter name of both years onto the package), so they are answered by the tests named, not by a section. "
    "A section has the name of its notebook (`notebooks/NN_<name>.py`, where the study modules it calls are "
    "named). The test counts are the `test_*` functions in each file; the status is read from the committed rows"
    + (
        " (what the handout asks for that no row covers is named: " + ", ".join(facts["not_run"]) + ")."
        if facts["not_run"]
        else "."
    )
)

# %% tags=["remove-input"]
show_table(
    problem_index.printed(table),
    caption="Every handout problem: where it is answered, the tests that cover it, its status",
    provenance_from="the index in cs336_systems/studies/overview/problem_index.py; counts and status read from tests/ "
    "and figures/data/ when this document was built",
    wrap={"problem": 0.2, "handout": 0.09, "answered in": 0.24, "tests (count)": 0.19, "status": 0.15},
    breakable=True,
    font="footnotesize",
)
