"""verl's one-step-off-policy recipe: generation of step k+1 overlaps the update of step k."""
