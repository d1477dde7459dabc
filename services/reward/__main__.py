from reinforce.reward.main import main

main()
