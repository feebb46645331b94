"""dspark: an online-learned, SLA- and context-aware verify-budget planner for SGLang's DSPARK."""
