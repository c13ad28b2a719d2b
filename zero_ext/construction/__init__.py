"""From torch param groups to a built sharded state: options, plan, agreement, build, add_param_group."""
