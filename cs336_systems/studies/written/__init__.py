"""Written problems: accounting computed from `cs336_systems.accounting`, nothing measured.

* `communication_accounting`: the 2025 communication_accounting problem (notebook 19).
* `parallelism_calcs`: the 2026 section 8 problems (notebook 32).
"""

STUDIES = ()  # nothing is measured here (the accounting is computed), so no study has the measuring shape
