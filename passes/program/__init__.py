"""Program passes (`ProgramPass`): they map a distributed program to a new one, in this order
(see fxspeed.passes.PROGRAM_PASSES): lower_schedule (the schedule), split_stages (one graph ->
stage programs), split_backward (the I/W split for zero-bubble schedules), accumulate_gradients
(stage programs accumulating gradients into buffers)."""
