"""Helpers of the tools (verl's ``verl.tools.utils`` at ``posttrain.tools.utils``)."""
