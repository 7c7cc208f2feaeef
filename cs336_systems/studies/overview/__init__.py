"""Overview: what spans every family (notebook 00 and the README).

* `problem_index`: every handout problem, where it is answered, its tests and status.
* `readme_summary`: the README's headline results, from the other families' committed rows; the
  one family that may import the others' studies (it quotes their facts).
"""

STUDIES = ()  # these read every family's rows and measure nothing, so no study has the measuring shape
