"""User-facing tools: the command line, the local launcher, the demo, plan visualisation."""
