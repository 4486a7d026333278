"""Dynamic entropy-balanced rollout: budget split, branch rules, rollout trees and the round scheduler."""
