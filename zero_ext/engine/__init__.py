"""The engine at run time: buckets and their communication, gradient reduction, parameter gathers, the step."""
