"""Event-driven cluster simulator driving the same planner, detector and mitigation code as the operator."""
